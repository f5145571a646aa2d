/*
 * TRITONSERVER_* basics (errors, messages, datatypes, parameters, logging, buffer
 * attributes, custom metrics) and the pyshim_* functions the Python host calls.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>

#include "shim_internal.h"

pyshim_callbacks g_cb;
int g_log_verbose = 0;
TRITONSERVER_Server g_server;

/* ---- helpers ------------------------------------------------------------------------- */
char* shim_strdup(const char* s) { return s ? strdup(s) : strdup(""); }

char* shim_strndup(const char* s, size_t n) {
  char* out = malloc(n + 1);
  if (out == NULL) return NULL;
  if (n) memcpy(out, s, n);
  out[n] = '\0';
  return out;
}

TRITONSERVER_Error* shim_error(TRITONSERVER_Error_Code code, const char* fmt, ...) {
  TRITONSERVER_Error* err = malloc(sizeof(*err));
  if (err == NULL) return NULL;
  va_list args;
  va_start(args, fmt);
  if (vasprintf(&err->message, fmt, args) < 0) err->message = strdup("(no message)");
  va_end(args);
  err->code = code;
  return err;
}

/* ---- errors ---------------------------------------------------------------------------- */
EXPORT TRITONSERVER_Error* TRITONSERVER_ErrorNew(TRITONSERVER_Error_Code code, const char* msg) {
  TRITONSERVER_Error* err = malloc(sizeof(*err));
  err->code = code;
  err->message = shim_strdup(msg);
  return err;
}

EXPORT void TRITONSERVER_ErrorDelete(TRITONSERVER_Error* error) {
  if (error == NULL) return;
  free(error->message);
  free(error);
}

EXPORT TRITONSERVER_Error_Code TRITONSERVER_ErrorCode(TRITONSERVER_Error* error) {
  return error ? error->code : TRITONSERVER_ERROR_UNKNOWN;
}

EXPORT const char* TRITONSERVER_ErrorCodeString(TRITONSERVER_Error* error) {
  static const char* names[] = {"Unknown",     "Internal",    "Not found",      "Invalid argument",
                                "Unavailable", "Unsupported", "Already exists", "Cancelled"};
  unsigned code = error ? (unsigned)error->code : 0;
  return code < 8 ? names[code] : "<invalid code>";
}

EXPORT const char* TRITONSERVER_ErrorMessage(TRITONSERVER_Error* error) {
  return error ? error->message : "";
}

/* ---- datatypes and other enum strings -------------------------------------------------- */
static const char* k_type_names[] = {"<invalid>", "BOOL",  "UINT8", "UINT16", "UINT32",
                                     "UINT64",    "INT8",  "INT16", "INT32",  "INT64",
                                     "FP16",      "FP32",  "FP64",  "BYTES",  "BF16"};
static const uint32_t k_type_sizes[] = {0, 1, 1, 2, 4, 8, 1, 2, 4, 8, 2, 4, 8, 0, 2};

EXPORT const char* TRITONSERVER_DataTypeString(TRITONSERVER_DataType datatype) {
  return (unsigned)datatype < 15 ? k_type_names[datatype] : "<invalid>";
}

EXPORT TRITONSERVER_DataType TRITONSERVER_StringToDataType(const char* dtype) {
  if (dtype == NULL) return TRITONSERVER_TYPE_INVALID;
  for (int i = 1; i < 15; i++)
    if (strcmp(dtype, k_type_names[i]) == 0) return (TRITONSERVER_DataType)i;
  return TRITONSERVER_TYPE_INVALID;
}

EXPORT uint32_t TRITONSERVER_DataTypeByteSize(TRITONSERVER_DataType datatype) {
  return (unsigned)datatype < 15 ? k_type_sizes[datatype] : 0;
}

EXPORT const char* TRITONSERVER_MemoryTypeString(TRITONSERVER_MemoryType memtype) {
  switch (memtype) {
    case TRITONSERVER_MEMORY_CPU: return "CPU";
    case TRITONSERVER_MEMORY_CPU_PINNED: return "CPU_PINNED";
    case TRITONSERVER_MEMORY_GPU: return "GPU";
  }
  return "<invalid>";
}

EXPORT const char* TRITONSERVER_ParameterTypeString(TRITONSERVER_ParameterType paramtype) {
  static const char* names[] = {"STRING", "INT", "BOOL", "DOUBLE", "BYTES"};
  return (unsigned)paramtype < 5 ? names[paramtype] : "<invalid>";
}

EXPORT const char* TRITONSERVER_InstanceGroupKindString(TRITONSERVER_InstanceGroupKind kind) {
  static const char* names[] = {"AUTO", "CPU", "GPU", "MODEL"};
  return (unsigned)kind < 4 ? names[kind] : "<invalid>";
}

/* ---- messages (JSON text) ------------------------------------------------------------- */
TRITONSERVER_Message* shim_message_new(const char* json) {
  TRITONSERVER_Message* m = malloc(sizeof(*m));
  m->json = shim_strdup(json);
  m->size = strlen(m->json);
  return m;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_MessageNewFromSerializedJson(
    TRITONSERVER_Message** message, const char* base, size_t byte_size) {
  SHIM_REQUIRE(message != NULL && (base != NULL || byte_size == 0), "null argument");
  TRITONSERVER_Message* m = malloc(sizeof(*m));
  m->json = shim_strndup(base ? base : "", byte_size);
  m->size = byte_size;
  *message = m;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_MessageDelete(TRITONSERVER_Message* message) {
  if (message != NULL) {
    free(message->json);
    free(message);
  }
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_MessageSerializeToJson(
    TRITONSERVER_Message* message, const char** base, size_t* byte_size) {
  SHIM_REQUIRE(message != NULL && base != NULL && byte_size != NULL, "null argument");
  *base = message->json;
  *byte_size = message->size;
  return NULL;
}

/* ---- parameters ----------------------------------------------------------------------- */
const void* shim_param_value(const pyshim_param* p) {
  switch (p->type) {
    case TRITONSERVER_PARAMETER_STRING: return p->str;
    case TRITONSERVER_PARAMETER_INT: return &p->i;
    case TRITONSERVER_PARAMETER_BOOL: return &p->b;
    case TRITONSERVER_PARAMETER_DOUBLE: return &p->d;
    case TRITONSERVER_PARAMETER_BYTES: return p->bytes;
  }
  return NULL;
}

void shim_param_clear(pyshim_param* p) {
  free(p->key);
  free(p->str);
  free(p->bytes);
  memset(p, 0, sizeof(*p));
}

int shim_params_add(
    pyshim_param** params, uint32_t* count, const char* key, int32_t type, const char* str,
    int64_t i, bool b, double d, const void* bytes, uint64_t size) {
  pyshim_param* grown = realloc(*params, sizeof(pyshim_param) * (*count + 1));
  if (grown == NULL) return -1;
  *params = grown;
  pyshim_param* p = &grown[*count];
  memset(p, 0, sizeof(*p));
  p->key = shim_strdup(key);
  p->type = type;
  if (type == TRITONSERVER_PARAMETER_STRING) p->str = shim_strdup(str);
  p->i = i;
  p->b = b;
  p->d = d;
  if (type == TRITONSERVER_PARAMETER_BYTES && size) {
    p->bytes = malloc(size);
    memcpy(p->bytes, bytes, size);
    p->size = size;
  }
  (*count)++;
  return 0;
}

EXPORT TRITONSERVER_Parameter* TRITONSERVER_ParameterNew(
    const char* name, const TRITONSERVER_ParameterType type, const void* value) {
  TRITONSERVER_Parameter* param = calloc(1, sizeof(*param));
  param->p.key = shim_strdup(name);
  param->p.type = type;
  switch (type) {
    case TRITONSERVER_PARAMETER_STRING: param->p.str = shim_strdup((const char*)value); break;
    case TRITONSERVER_PARAMETER_INT: param->p.i = value ? *(const int64_t*)value : 0; break;
    case TRITONSERVER_PARAMETER_BOOL: param->p.b = value ? *(const bool*)value : false; break;
    case TRITONSERVER_PARAMETER_DOUBLE: param->p.d = value ? *(const double*)value : 0.0; break;
    default: /* BYTES needs a size: use TRITONSERVER_ParameterBytesNew */
      free(param->p.key);
      free(param);
      return NULL;
  }
  return param;
}

EXPORT TRITONSERVER_Parameter* TRITONSERVER_ParameterBytesNew(
    const char* name, const void* byte_ptr, const uint64_t size) {
  TRITONSERVER_Parameter* param = calloc(1, sizeof(*param));
  param->p.key = shim_strdup(name);
  param->p.type = TRITONSERVER_PARAMETER_BYTES;
  /* Triton keeps a reference to the caller's bytes; a copy is as good and safer. */
  if (size) {
    param->p.bytes = malloc(size);
    memcpy(param->p.bytes, byte_ptr, size);
  }
  param->p.size = size;
  return param;
}

EXPORT void TRITONSERVER_ParameterDelete(TRITONSERVER_Parameter* parameter) {
  if (parameter == NULL) return;
  shim_param_clear(&parameter->p);
  free(parameter);
}

/* ---- logging -------------------------------------------------------------------------- */
EXPORT bool TRITONSERVER_LogIsEnabled(TRITONSERVER_LogLevel level) {
  return level != TRITONSERVER_LOG_VERBOSE || g_log_verbose > 0;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_LogMessage(
    TRITONSERVER_LogLevel level, const char* filename, const int line, const char* msg) {
  if (level == TRITONSERVER_LOG_VERBOSE && g_log_verbose <= 0) return NULL;
  if (g_cb.log != NULL) g_cb.log((int32_t)level, filename ? filename : "", line, msg ? msg : "");
  return NULL;
}

/* ---- buffer attributes --------------------------------------------------------------- */
EXPORT TRITONSERVER_Error* TRITONSERVER_BufferAttributesNew(TRITONSERVER_BufferAttributes** attrs) {
  SHIM_REQUIRE(attrs != NULL, "null argument");
  *attrs = calloc(1, sizeof(**attrs));
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_BufferAttributesDelete(TRITONSERVER_BufferAttributes* attrs) {
  free(attrs);
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_BufferAttributesSetMemoryTypeId(
    TRITONSERVER_BufferAttributes* attrs, int64_t memory_type_id) {
  SHIM_REQUIRE(attrs != NULL, "null argument");
  attrs->memory_type_id = memory_type_id;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_BufferAttributesSetMemoryType(
    TRITONSERVER_BufferAttributes* attrs, TRITONSERVER_MemoryType memory_type) {
  SHIM_REQUIRE(attrs != NULL, "null argument");
  attrs->memory_type = memory_type;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_BufferAttributesSetCudaIpcHandle(
    TRITONSERVER_BufferAttributes* attrs, void* cuda_ipc_handle) {
  SHIM_REQUIRE(attrs != NULL, "null argument");
  attrs->cuda_ipc_handle = cuda_ipc_handle;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_BufferAttributesSetByteSize(
    TRITONSERVER_BufferAttributes* attrs, size_t byte_size) {
  SHIM_REQUIRE(attrs != NULL, "null argument");
  attrs->byte_size = byte_size;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_BufferAttributesMemoryTypeId(
    TRITONSERVER_BufferAttributes* attrs, int64_t* memory_type_id) {
  SHIM_REQUIRE(attrs != NULL && memory_type_id != NULL, "null argument");
  *memory_type_id = attrs->memory_type_id;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_BufferAttributesMemoryType(
    TRITONSERVER_BufferAttributes* attrs, TRITONSERVER_MemoryType* memory_type) {
  SHIM_REQUIRE(attrs != NULL && memory_type != NULL, "null argument");
  *memory_type = attrs->memory_type;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_BufferAttributesCudaIpcHandle(
    TRITONSERVER_BufferAttributes* attrs, void** cuda_ipc_handle) {
  SHIM_REQUIRE(attrs != NULL && cuda_ipc_handle != NULL, "null argument");
  *cuda_ipc_handle = attrs->cuda_ipc_handle;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_BufferAttributesByteSize(
    TRITONSERVER_BufferAttributes* attrs, size_t* byte_size) {
  SHIM_REQUIRE(attrs != NULL && byte_size != NULL, "null argument");
  *byte_size = attrs->byte_size;
  return NULL;
}

/* ---- custom metrics ------------------------------------------------------------------ *
 * Families and metrics live in a process-wide registry (guarded by g_metrics_lock) that the
 * Python host renders in Prometheus text format (pyshim_metrics_text). A family or metric is
 * owned by the backend that created it and removed from the registry when deleted. */
struct TRITONSERVER_MetricArgs {
  double* buckets;
  uint64_t bucket_count;
};

struct TRITONSERVER_Metric {
  TRITONSERVER_MetricFamily* family;
  char* labels; /* rendered {k="v",...} or "" */
  double value;  /* counter / gauge value, or histogram sum */
  uint64_t count; /* histogram observations */
  double* buckets;
  uint64_t* bucket_counts;
  uint64_t bucket_count;
  struct TRITONSERVER_Metric* next;
};

struct TRITONSERVER_MetricFamily {
  TRITONSERVER_MetricKind kind;
  char* name;
  char* description;
  struct TRITONSERVER_Metric* metrics;
  struct TRITONSERVER_MetricFamily* next;
};

static pthread_mutex_t g_metrics_lock = PTHREAD_MUTEX_INITIALIZER;
static TRITONSERVER_MetricFamily* g_families = NULL;

EXPORT TRITONSERVER_Error* TRITONSERVER_MetricFamilyNew(
    TRITONSERVER_MetricFamily** family, const TRITONSERVER_MetricKind kind, const char* name,
    const char* description) {
  SHIM_REQUIRE(family != NULL && name != NULL, "null argument");
  if ((unsigned)kind > TRITONSERVER_METRIC_KIND_HISTOGRAM)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "unknown metric kind %d", (int)kind);
  TRITONSERVER_MetricFamily* f = calloc(1, sizeof(*f));
  f->kind = kind;
  f->name = shim_strdup(name);
  f->description = shim_strdup(description);
  pthread_mutex_lock(&g_metrics_lock);
  f->next = g_families;
  g_families = f;
  pthread_mutex_unlock(&g_metrics_lock);
  *family = f;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_MetricFamilyDelete(TRITONSERVER_MetricFamily* family) {
  SHIM_REQUIRE(family != NULL, "null family");
  pthread_mutex_lock(&g_metrics_lock);
  if (family->metrics != NULL) {
    pthread_mutex_unlock(&g_metrics_lock);
    return shim_error(TRITONSERVER_ERROR_INTERNAL,
                      "metric family '%s' still has metrics; delete them first", family->name);
  }
  for (TRITONSERVER_MetricFamily** p = &g_families; *p; p = &(*p)->next)
    if (*p == family) {
      *p = family->next;
      break;
    }
  pthread_mutex_unlock(&g_metrics_lock);
  free(family->name);
  free(family->description);
  free(family);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_GetMetricFamilyKind(
    TRITONSERVER_MetricFamily* family, TRITONSERVER_MetricKind* kind) {
  SHIM_REQUIRE(family != NULL && kind != NULL, "null argument");
  *kind = family->kind;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_MetricArgsNew(TRITONSERVER_MetricArgs** args) {
  SHIM_REQUIRE(args != NULL, "null argument");
  *args = calloc(1, sizeof(**args));
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_MetricArgsSetHistogram(
    TRITONSERVER_MetricArgs* args, const double* buckets, const uint64_t buckets_count) {
  SHIM_REQUIRE(args != NULL && (buckets != NULL || buckets_count == 0), "null argument");
  free(args->buckets);
  args->buckets = malloc(sizeof(double) * (buckets_count ? buckets_count : 1));
  if (buckets_count) memcpy(args->buckets, buckets, sizeof(double) * buckets_count);
  args->bucket_count = buckets_count;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_MetricArgsDelete(TRITONSERVER_MetricArgs* args) {
  if (args != NULL) {
    free(args->buckets);
    free(args);
  }
  return NULL;
}

static char* render_labels(const TRITONSERVER_Parameter** labels, uint64_t count) {
  size_t cap = 3;
  for (uint64_t i = 0; i < count; i++)
    if (labels[i] && labels[i]->p.type == TRITONSERVER_PARAMETER_STRING)
      cap += strlen(labels[i]->p.key) + 2 * strlen(labels[i]->p.str) + 5;
  char* out = malloc(cap);
  size_t n = 0;
  out[0] = '\0';
  for (uint64_t i = 0; i < count; i++) {
    if (!labels[i] || labels[i]->p.type != TRITONSERVER_PARAMETER_STRING) continue;
    n += (size_t)sprintf(out + n, "%s%s=\"", n ? "," : "", labels[i]->p.key);
    for (const char* c = labels[i]->p.str; *c; c++) {
      if (*c == '"' || *c == '\\') out[n++] = '\\';
      out[n++] = *c;
    }
    out[n++] = '"';
    out[n] = '\0';
  }
  return out;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_MetricNewWithArgs(
    TRITONSERVER_Metric** metric, TRITONSERVER_MetricFamily* family,
    const TRITONSERVER_Parameter** labels, const uint64_t label_count,
    const TRITONSERVER_MetricArgs* args) {
  SHIM_REQUIRE(metric != NULL && family != NULL, "null argument");
  for (uint64_t i = 0; i < label_count; i++)
    if (labels[i] == NULL || labels[i]->p.type != TRITONSERVER_PARAMETER_STRING)
      return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "metric labels must be STRING parameters");
  if (family->kind == TRITONSERVER_METRIC_KIND_HISTOGRAM && (args == NULL || args->buckets == NULL))
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG,
                      "a histogram metric needs buckets (TRITONSERVER_MetricArgsSetHistogram)");
  TRITONSERVER_Metric* m = calloc(1, sizeof(*m));
  m->family = family;
  m->labels = render_labels(labels, label_count);
  if (family->kind == TRITONSERVER_METRIC_KIND_HISTOGRAM) {
    m->bucket_count = args->bucket_count;
    m->buckets = malloc(sizeof(double) * (args->bucket_count + 1));
    memcpy(m->buckets, args->buckets, sizeof(double) * args->bucket_count);
    m->bucket_counts = calloc(args->bucket_count + 1, sizeof(uint64_t));
  }
  pthread_mutex_lock(&g_metrics_lock);
  m->next = family->metrics;
  family->metrics = m;
  pthread_mutex_unlock(&g_metrics_lock);
  *metric = m;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_MetricNew(
    TRITONSERVER_Metric** metric, TRITONSERVER_MetricFamily* family,
    const TRITONSERVER_Parameter** labels, const uint64_t label_count) {
  if (family != NULL && family->kind == TRITONSERVER_METRIC_KIND_HISTOGRAM)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG,
                      "use TRITONSERVER_MetricNewWithArgs for histogram metrics");
  return TRITONSERVER_MetricNewWithArgs(metric, family, labels, label_count, NULL);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_MetricDelete(TRITONSERVER_Metric* metric) {
  SHIM_REQUIRE(metric != NULL, "null metric");
  pthread_mutex_lock(&g_metrics_lock);
  for (TRITONSERVER_Metric** p = &metric->family->metrics; *p; p = &(*p)->next)
    if (*p == metric) {
      *p = metric->next;
      break;
    }
  pthread_mutex_unlock(&g_metrics_lock);
  free(metric->labels);
  free(metric->buckets);
  free(metric->bucket_counts);
  free(metric);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_MetricValue(TRITONSERVER_Metric* metric, double* value) {
  SHIM_REQUIRE(metric != NULL && value != NULL, "null argument");
  if (metric->family->kind == TRITONSERVER_METRIC_KIND_HISTOGRAM)
    return shim_error(TRITONSERVER_ERROR_UNSUPPORTED, "histogram metrics have no single value");
  pthread_mutex_lock(&g_metrics_lock);
  *value = metric->value;
  pthread_mutex_unlock(&g_metrics_lock);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_MetricIncrement(TRITONSERVER_Metric* metric, double value) {
  SHIM_REQUIRE(metric != NULL, "null metric");
  TRITONSERVER_MetricKind kind = metric->family->kind;
  if (kind == TRITONSERVER_METRIC_KIND_HISTOGRAM)
    return shim_error(TRITONSERVER_ERROR_UNSUPPORTED, "histogram metrics cannot be incremented");
  if (kind == TRITONSERVER_METRIC_KIND_COUNTER && value < 0)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "a counter cannot be decremented");
  pthread_mutex_lock(&g_metrics_lock);
  metric->value += value;
  pthread_mutex_unlock(&g_metrics_lock);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_MetricSet(TRITONSERVER_Metric* metric, double value) {
  SHIM_REQUIRE(metric != NULL, "null metric");
  if (metric->family->kind != TRITONSERVER_METRIC_KIND_GAUGE)
    return shim_error(TRITONSERVER_ERROR_UNSUPPORTED, "only gauge metrics can be set");
  pthread_mutex_lock(&g_metrics_lock);
  metric->value = value;
  pthread_mutex_unlock(&g_metrics_lock);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_MetricObserve(TRITONSERVER_Metric* metric, double value) {
  SHIM_REQUIRE(metric != NULL, "null metric");
  if (metric->family->kind != TRITONSERVER_METRIC_KIND_HISTOGRAM)
    return shim_error(TRITONSERVER_ERROR_UNSUPPORTED, "only histogram metrics can observe");
  pthread_mutex_lock(&g_metrics_lock);
  metric->value += value;
  metric->count++;
  for (uint64_t i = 0; i < metric->bucket_count; i++)
    if (value <= metric->buckets[i]) metric->bucket_counts[i]++;
  pthread_mutex_unlock(&g_metrics_lock);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_GetMetricKind(
    TRITONSERVER_Metric* metric, TRITONSERVER_MetricKind* kind) {
  SHIM_REQUIRE(metric != NULL && kind != NULL, "null argument");
  *kind = metric->family->kind;
  return NULL;
}

/* ---- the host API (called by Python) ---------------------------------------------- */
EXPORT void pyshim_set_callbacks(const pyshim_callbacks* callbacks) { g_cb = *callbacks; }
EXPORT void pyshim_set_log_verbose(int level) { g_log_verbose = level; }
EXPORT void pyshim_free(void* ptr) { free(ptr); }
EXPORT void pyshim_api_version(uint32_t out[4]) {
  out[0] = TRITONBACKEND_API_VERSION_MAJOR;
  out[1] = TRITONBACKEND_API_VERSION_MINOR;
  out[2] = TRITONSERVER_API_VERSION_MAJOR;
  out[3] = TRITONSERVER_API_VERSION_MINOR;
}

/* Reads an error (NULL = success) and deletes it. Returns the code, or -1 for NULL; the
 * message (malloc'd, caller frees with pyshim_free) goes to *message. */
EXPORT int32_t pyshim_take_error(TRITONSERVER_Error* error, char** message) {
  if (error == NULL) {
    *message = NULL;
    return -1;
  }
  int32_t code = (int32_t)error->code;
  *message = error->message;
  free(error);
  return code;
}

/* Custom metrics in Prometheus text format; the caller frees the text with pyshim_free. */
EXPORT char* pyshim_metrics_text(void) {
  size_t cap = 4096, n = 0;
  char* out = malloc(cap);
  out[0] = '\0';
#define APPEND(...)                                                       \
  do {                                                                    \
    int need = snprintf(NULL, 0, __VA_ARGS__);                            \
    while (n + (size_t)need + 1 > cap) out = realloc(out, cap *= 2);      \
    n += (size_t)snprintf(out + n, cap - n, __VA_ARGS__);                 \
  } while (0)
  static const char* kinds[] = {"counter", "gauge", "histogram"};
  pthread_mutex_lock(&g_metrics_lock);
  for (TRITONSERVER_MetricFamily* f = g_families; f; f = f->next) {
    APPEND("# HELP %s %s\n# TYPE %s %s\n", f->name, f->description, f->name, kinds[f->kind]);
    for (TRITONSERVER_Metric* m = f->metrics; m; m = m->next) {
      const char* sep = m->labels[0] ? "," : "";
      if (f->kind != TRITONSERVER_METRIC_KIND_HISTOGRAM) {
        APPEND("%s{%s} %.17g\n", f->name, m->labels, m->value);
        continue;
      }
      for (uint64_t i = 0; i < m->bucket_count; i++)
        APPEND("%s_bucket{%s%sle=\"%g\"} %llu\n", f->name, m->labels, sep, m->buckets[i],
               (unsigned long long)m->bucket_counts[i]);
      APPEND("%s_bucket{%s%sle=\"+Inf\"} %llu\n", f->name, m->labels, sep,
             (unsigned long long)m->count);
      APPEND("%s_sum{%s} %.17g\n%s_count{%s} %llu\n", f->name, m->labels, m->value, f->name,
             m->labels, (unsigned long long)m->count);
    }
  }
  pthread_mutex_unlock(&g_metrics_lock);
#undef APPEND
  return out;
}

/* Result slots for PYSHIM_QUERY_* answers. */
EXPORT void pyshim_result_set(pyshim_result* result, int64_t ival, const char* sval) {
  result->ival = ival;
  free(result->sval);
  result->sval = sval ? strdup(sval) : NULL;
  result->err_code = -1;
}

EXPORT void pyshim_result_error(pyshim_result* result, int32_t code, const char* message) {
  result->err_code = code;
  free(result->err_msg);
  result->err_msg = shim_strdup(message);
}
