/*
 * The TRITONSERVER_Server* functions about the server as a whole (health, metadata, index,
 * statistics, metrics, model control) for a backend calling the server that hosts it
 * (TRITONBACKEND_ModelServer), TRITONSERVER_Metrics, and TRITONSERVER_ServerOptions.
 *
 * What pyserve's command line owns is refused with UNSUPPORTED and a message saying so: a
 * second in-process server (TRITONSERVER_ServerNew), stopping or deleting the host server,
 * and registering repositories. TRITONSERVER_ServerOptions objects hold their settings (a
 * backend may build one); only ServerNew would use them.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>

#include "shim_internal.h"

EXPORT TRITONSERVER_Error* TRITONSERVER_ApiVersion(uint32_t* major, uint32_t* minor) {
  SHIM_REQUIRE(major != NULL && minor != NULL, "null argument");
  *major = TRITONSERVER_API_VERSION_MAJOR;
  *minor = TRITONSERVER_API_VERSION_MINOR;
  return NULL;
}

/* ---- health, metadata, index, statistics ------------------------------------------------ */
static TRITONSERVER_Error* query_flag(TRITONSERVER_Server* server, int32_t op, bool* out) {
  SHIM_REQUIRE(out != NULL, "null argument");
  pyshim_result res;
  TRITONSERVER_Error* err = shim_query(server, op, "", 0, &res);
  if (err) return err;
  free(res.sval);
  *out = res.ival != 0;
  return NULL;
}

static TRITONSERVER_Error* query_message(
    TRITONSERVER_Server* server, int32_t op, const char* model, int64_t version, TRITONSERVER_Message** out) {
  SHIM_REQUIRE(out != NULL, "null argument");
  pyshim_result res;
  TRITONSERVER_Error* err = shim_query(server, op, model, version, &res);
  if (err) return err;
  *out = shim_message_new(res.sval ? res.sval : "{}");
  free(res.sval);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerIsLive(TRITONSERVER_Server* server, bool* live) {
  return query_flag(server, PYSHIM_QUERY_LIVE, live);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerIsReady(TRITONSERVER_Server* server, bool* ready) {
  return query_flag(server, PYSHIM_QUERY_SERVER_READY, ready);
}

/* {"name", "version", "extensions"}: what the metadata endpoint answers. */
EXPORT TRITONSERVER_Error* TRITONSERVER_ServerMetadata(TRITONSERVER_Server* server, TRITONSERVER_Message** server_metadata) {
  return query_message(server, PYSHIM_QUERY_SERVER_METADATA, "", 0, server_metadata);
}

/* The repository index (a JSON array); TRITONSERVER_INDEX_FLAG_READY: READY versions only. */
EXPORT TRITONSERVER_Error* TRITONSERVER_ServerModelIndex(
    TRITONSERVER_Server* server, uint32_t flags, TRITONSERVER_Message** model_index) {
  return query_message(server, PYSHIM_QUERY_INDEX, "", (int64_t)flags, model_index);
}

/* {"model_stats": [...]} for every model ("" name), one model (version -1) or one version. */
EXPORT TRITONSERVER_Error* TRITONSERVER_ServerModelStatistics(
    TRITONSERVER_Server* server, const char* model_name, const int64_t model_version,
    TRITONSERVER_Message** model_stats) {
  return query_message(server, PYSHIM_QUERY_STATISTICS, model_name ? model_name : "", model_version, model_stats);
}

/* ---- metrics ---------------------------------------------------------------------------------- */
struct TRITONSERVER_Metrics {
  char* text;
  size_t size;
};

/* The server's /metrics page as it is now (the caller deletes it with TRITONSERVER_MetricsDelete). */
EXPORT TRITONSERVER_Error* TRITONSERVER_ServerMetrics(TRITONSERVER_Server* server, TRITONSERVER_Metrics** metrics) {
  SHIM_REQUIRE(metrics != NULL, "null argument");
  pyshim_result res;
  TRITONSERVER_Error* err = shim_query(server, PYSHIM_QUERY_METRICS, "", 0, &res);
  if (err) return err;
  TRITONSERVER_Metrics* m = malloc(sizeof(*m));
  m->text = res.sval != NULL ? res.sval : shim_strdup("");
  m->size = strlen(m->text);
  *metrics = m;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_MetricsFormatted(
    TRITONSERVER_Metrics* metrics, TRITONSERVER_MetricFormat format, const char** base, size_t* byte_size) {
  SHIM_REQUIRE(metrics != NULL && base != NULL && byte_size != NULL, "null argument");
  if (format != TRITONSERVER_METRIC_PROMETHEUS)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "unknown metrics format %d", (int)format);
  *base = metrics->text;
  *byte_size = metrics->size;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_MetricsDelete(TRITONSERVER_Metrics* metrics) {
  if (metrics != NULL) {
    free(metrics->text);
    free(metrics);
  }
  return NULL;
}

/* ---- model control (explicit mode, as the repository API) ---------------------------------- */
static TRITONSERVER_Error* control(TRITONSERVER_Server* server, int32_t op, const char* model_name) {
  SHIM_REQUIRE(model_name != NULL, "null model name");
  pyshim_result res;
  TRITONSERVER_Error* err = shim_query(server, op, model_name, 0, &res);
  if (err) return err;
  free(res.sval);
  return NULL;
}

/* Loads or reloads a model and returns once it is READY (an error when the load failed or the
 * server is not in explicit model control mode). Do not load the calling model itself. */
EXPORT TRITONSERVER_Error* TRITONSERVER_ServerLoadModel(TRITONSERVER_Server* server, const char* model_name) {
  return control(server, PYSHIM_QUERY_LOAD, model_name);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerLoadModelWithParameters(
    TRITONSERVER_Server* server, const char* model_name, const TRITONSERVER_Parameter** parameters,
    const uint64_t parameter_count) {
  SHIM_REQUIRE(parameters != NULL || parameter_count == 0, "null parameters");
  if (parameter_count != 0)
    return shim_error(TRITONSERVER_ERROR_UNSUPPORTED,
                      "model '%s': load parameters (config, file:) are not supported through pyserve's "
                      "TRITON API; use the repository API (POST /v2/repository/models/%s/load)",
                      model_name ? model_name : "", model_name ? model_name : "");
  return control(server, PYSHIM_QUERY_LOAD, model_name);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerUnloadModel(TRITONSERVER_Server* server, const char* model_name) {
  return control(server, PYSHIM_QUERY_UNLOAD, model_name);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerUnloadModelAndDependents(TRITONSERVER_Server* server, const char* model_name) {
  return control(server, PYSHIM_QUERY_UNLOAD_DEPENDENTS, model_name);
}

/* ---- what belongs to pyserve's command line ------------------------------------------------ */
static TRITONSERVER_Error* owned_by_pyserve(const char* what) {
  return shim_error(TRITONSERVER_ERROR_UNSUPPORTED,
                    "%s: the server hosting this backend is pyserve's; it is started, stopped and "
                    "configured by pyserve's command line, not through the TRITONSERVER API", what);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerNew(TRITONSERVER_Server** server, TRITONSERVER_ServerOptions* options) {
  (void)options;
  if (server != NULL) *server = NULL;
  return shim_error(TRITONSERVER_ERROR_UNSUPPORTED,
                    "TRITONSERVER_ServerNew: a backend hosted by pyserve cannot start another in-process "
                    "server; call the hosting server (TRITONBACKEND_ModelServer) instead");
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerDelete(TRITONSERVER_Server* server) {
  (void)server;
  return owned_by_pyserve("TRITONSERVER_ServerDelete");
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerStop(TRITONSERVER_Server* server) {
  (void)server;
  return owned_by_pyserve("TRITONSERVER_ServerStop");
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerSetExitTimeout(TRITONSERVER_Server* server, unsigned int timeout) {
  (void)server; (void)timeout;
  return owned_by_pyserve("TRITONSERVER_ServerSetExitTimeout (use --exit-timeout-secs)");
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerRegisterModelRepository(
    TRITONSERVER_Server* server, const char* repository_path, const TRITONSERVER_Parameter** name_mapping,
    const uint32_t mapping_count) {
  (void)server; (void)repository_path; (void)name_mapping; (void)mapping_count;
  return owned_by_pyserve("TRITONSERVER_ServerRegisterModelRepository (use --model-repository)");
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerUnregisterModelRepository(TRITONSERVER_Server* server, const char* repository_path) {
  (void)server; (void)repository_path;
  return owned_by_pyserve("TRITONSERVER_ServerUnregisterModelRepository");
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerPollModelRepository(TRITONSERVER_Server* server) {
  (void)server;
  return owned_by_pyserve("TRITONSERVER_ServerPollModelRepository (use --model-control-mode poll)");
}

/* ---- server options: a settings object --------------------------------------------------------- */
struct TRITONSERVER_ServerOptions {
  uint32_t count, capacity;
  char** settings; /* "group\x1fkey\x1fvalue" entries, in the order set */
};

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptionsNew(TRITONSERVER_ServerOptions** options) {
  SHIM_REQUIRE(options != NULL, "null argument");
  *options = calloc(1, sizeof(**options));
  return *options ? NULL : shim_error(TRITONSERVER_ERROR_INTERNAL, "out of memory");
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptionsDelete(TRITONSERVER_ServerOptions* options) {
  if (options == NULL) return NULL;
  for (uint32_t i = 0; i < options->count; i++) free(options->settings[i]);
  free(options->settings);
  free(options);
  return NULL;
}

static TRITONSERVER_Error* put(TRITONSERVER_ServerOptions* o, const char* group, const char* key, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
static TRITONSERVER_Error* put(TRITONSERVER_ServerOptions* o, const char* group, const char* key, const char* fmt, ...) {
  if (o == NULL) return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "null server options");
  char* value = NULL;
  va_list args;
  va_start(args, fmt);
  int n = vasprintf(&value, fmt, args);
  va_end(args);
  if (n < 0) return shim_error(TRITONSERVER_ERROR_INTERNAL, "out of memory");
  char* entry = NULL;
  n = asprintf(&entry, "%s\x1f%s\x1f%s", group ? group : "", key ? key : "", value);
  free(value);
  if (n < 0) return shim_error(TRITONSERVER_ERROR_INTERNAL, "out of memory");
  if (o->count == o->capacity) {
    uint32_t cap = o->capacity ? o->capacity * 2 : 8;
    char** grown = realloc(o->settings, sizeof(char*) * cap);
    if (grown == NULL) {
      free(entry);
      return shim_error(TRITONSERVER_ERROR_INTERNAL, "out of memory");
    }
    o->settings = grown;
    o->capacity = cap;
  }
  o->settings[o->count++] = entry;
  return NULL;
}

#define S(x) ((x) ? (x) : "")
#define OPTION_STR(fn, key)                                                                 \
  EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptions##fn(TRITONSERVER_ServerOptions* options, \
                                                            const char* value) {          \
    return put(options, "", key, "%s", S(value));                                          \
  }
#define OPTION_BOOL(fn, key)                                                                \
  EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptions##fn(TRITONSERVER_ServerOptions* options, bool value) { \
    return put(options, "", key, "%s", value ? "true" : "false");                         \
  }
#define OPTION_UINT(fn, key, type)                                                          \
  EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptions##fn(TRITONSERVER_ServerOptions* options, type value) { \
    return put(options, "", key, "%llu", (unsigned long long)value);                      \
  }

OPTION_STR(SetServerId, "id")
OPTION_STR(SetModelRepositoryPath, "model-repository")
OPTION_STR(SetStartupModel, "load-model")
OPTION_STR(SetModelConfigName, "model-config-name")
OPTION_STR(SetCacheDirectory, "cache-directory")
OPTION_STR(SetLogFile, "log-file")
OPTION_STR(SetBackendDirectory, "backend-directory")
OPTION_STR(SetRepoAgentDirectory, "repoagent-directory")
OPTION_BOOL(SetStrictModelConfig, "strict-model-config")
OPTION_BOOL(SetExitOnError, "exit-on-error")
OPTION_BOOL(SetStrictReadiness, "strict-readiness")
OPTION_BOOL(SetModelNamespacing, "model-namespacing")
OPTION_BOOL(SetEnablePeerAccess, "enable-peer-access")
OPTION_BOOL(SetLogInfo, "log-info")
OPTION_BOOL(SetLogWarn, "log-warning")
OPTION_BOOL(SetLogError, "log-error")
OPTION_BOOL(SetMetrics, "allow-metrics")
OPTION_BOOL(SetGpuMetrics, "allow-gpu-metrics")
OPTION_BOOL(SetCpuMetrics, "allow-cpu-metrics")
OPTION_UINT(SetPinnedMemoryPoolByteSize, "pinned-memory-pool-byte-size", uint64_t)
OPTION_UINT(SetResponseCacheByteSize, "response-cache-byte-size", uint64_t)
OPTION_UINT(SetExitTimeout, "exit-timeout-secs", unsigned int)
OPTION_UINT(SetBufferManagerThreadCount, "buffer-manager-thread-count", unsigned int)
OPTION_UINT(SetModelLoadThreadCount, "model-load-thread-count", unsigned int)
OPTION_UINT(SetModelLoadRetryCount, "model-load-retry-count", unsigned int)
OPTION_UINT(SetMetricsInterval, "metrics-interval-ms", uint64_t)

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetModelControlMode(
    TRITONSERVER_ServerOptions* options, TRITONSERVER_ModelControlMode mode) {
  static const char* names[] = {"none", "poll", "explicit"};
  if ((unsigned)mode > 2) return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "unknown model control mode %d", (int)mode);
  return put(options, "", "model-control-mode", "%s", names[mode]);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetRateLimiterMode(
    TRITONSERVER_ServerOptions* options, TRITONSERVER_RateLimitMode mode) {
  if ((unsigned)mode > 1) return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "unknown rate limiter mode %d", (int)mode);
  return put(options, "", "rate-limit", "%s", mode ? "execution_count" : "off");
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptionsAddRateLimiterResource(
    TRITONSERVER_ServerOptions* options, const char* resource_name, const size_t resource_count, const int device) {
  return put(options, "rate-limit-resource", S(resource_name), "%zu:%d", resource_count, device);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetCudaMemoryPoolByteSize(
    TRITONSERVER_ServerOptions* options, int gpu_device, uint64_t size) {
  return put(options, "cuda-memory-pool-byte-size", "", "%d:%llu", gpu_device, (unsigned long long)size);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetCudaVirtualAddressSize(
    TRITONSERVER_ServerOptions* options, int gpu_device, size_t cuda_virtual_address_size) {
  return put(options, "cuda-virtual-address-size", "", "%d:%zu", gpu_device, cuda_virtual_address_size);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetCacheConfig(
    TRITONSERVER_ServerOptions* options, const char* cache_name, const char* config_json) {
  return put(options, "cache-config", S(cache_name), "%s", S(config_json));
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetMinSupportedComputeCapability(
    TRITONSERVER_ServerOptions* options, double cc) {
  return put(options, "", "min-supported-compute-capability", "%f", cc);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetLogFormat(
    TRITONSERVER_ServerOptions* options, const TRITONSERVER_LogFormat format) {
  if ((unsigned)format > 1) return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "unknown log format %d", (int)format);
  return put(options, "", "log-format", "%s", format ? "ISO8601" : "default");
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetLogVerbose(TRITONSERVER_ServerOptions* options, int level) {
  return put(options, "", "log-verbose", "%d", level);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetModelLoadDeviceLimit(
    TRITONSERVER_ServerOptions* options, const TRITONSERVER_InstanceGroupKind kind, const int device_id,
    const double fraction) {
  if (fraction < 0.0 || fraction > 1.0)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "a model load device limit must be within [0, 1], got %f", fraction);
  return put(options, "model-load-gpu-limit", TRITONSERVER_InstanceGroupKindString(kind), "%d:%f", device_id, fraction);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetBackendConfig(
    TRITONSERVER_ServerOptions* options, const char* backend_name, const char* setting, const char* value) {
  return put(options, "backend-config", S(backend_name), "%s=%s", S(setting), S(value));
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetHostPolicy(
    TRITONSERVER_ServerOptions* options, const char* policy_name, const char* setting, const char* value) {
  return put(options, "host-policy", S(policy_name), "%s=%s", S(setting), S(value));
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetMetricsConfig(
    TRITONSERVER_ServerOptions* options, const char* name, const char* setting, const char* value) {
  return put(options, "metrics-config", S(name), "%s=%s", S(setting), S(value));
}
