/*
 * Internals of pyserve's TRITON host shim: object layouts, the callbacks into Python and the
 * pyshim_* functions the Python host drives through ctypes.
 *
 * Threading: backends call the API from any thread (execute threads, their own worker
 * threads). The shim never holds one of its own locks while calling into Python, so a
 * Python callback can call back into the shim without deadlocking.
 */
#ifndef PYSERVE_SHIM_INTERNAL_H
#define PYSERVE_SHIM_INTERNAL_H

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "triton_shim.h"

#define EXPORT __attribute__((visibility("default")))
#define INTERNAL __attribute__((visibility("hidden")))

/* ---- small helpers ------------------------------------------------------------------- */
INTERNAL char* shim_strdup(const char* s);
INTERNAL char* shim_strndup(const char* s, size_t n);
INTERNAL TRITONSERVER_Error* shim_error(TRITONSERVER_Error_Code code, const char* fmt, ...)
    __attribute__((format(printf, 2, 3)));
#define SHIM_REQUIRE(cond, what)                                                          \
  do {                                                                                    \
    if (!(cond))                                                                          \
      return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "%s: %s", __func__, what);        \
  } while (0)

struct TRITONSERVER_Error {
  TRITONSERVER_Error_Code code;
  char* message;
};

struct TRITONSERVER_Message {
  char* json; /* NUL-terminated copy */
  size_t size;
};
INTERNAL TRITONSERVER_Message* shim_message_new(const char* json);

struct TRITONSERVER_BufferAttributes {
  TRITONSERVER_MemoryType memory_type;
  int64_t memory_type_id;
  size_t byte_size;
  void* cuda_ipc_handle;
};

/* A parameter (request, response, BLS request, TRITONSERVER_Parameter). The layout is read
 * by Python (pyshim_param in _api.py): keep both in step. */
typedef struct pyshim_param {
  char* key;
  int32_t type; /* TRITONSERVER_ParameterType */
  char* str;    /* STRING */
  int64_t i;    /* INT */
  bool b;       /* BOOL */
  double d;     /* DOUBLE */
  void* bytes;  /* BYTES (owned copy) */
  uint64_t size;
} pyshim_param;
INTERNAL const void* shim_param_value(const pyshim_param* p);
INTERNAL void shim_param_clear(pyshim_param* p);
INTERNAL int shim_params_add(
    pyshim_param** params, uint32_t* count, const char* key, int32_t type, const char* str,
    int64_t i, bool b, double d, const void* bytes, uint64_t size);

struct TRITONSERVER_Parameter {
  pyshim_param p;
};

/* The description of one output tensor handed to Python (pyshim_output_desc in _api.py). */
typedef struct pyshim_output_desc {
  const char* name;
  int32_t datatype;
  uint32_t dims_count;
  const int64_t* shape;
  void* buffer; /* ownership passes with the description, see callbacks below */
  uint64_t byte_size;
} pyshim_output_desc;

/* ---- callbacks into Python ------------------------------------------------------------- */
enum { PYSHIM_EVENT_RELEASED = 1, PYSHIM_EVENT_DONE = 2 };
enum {
  PYSHIM_QUERY_READY = 1,
  PYSHIM_QUERY_TXN = 2,
  PYSHIM_QUERY_CONFIG = 3,
  PYSHIM_QUERY_METADATA = 4,
  PYSHIM_QUERY_BATCH = 5,
  PYSHIM_QUERY_LIVE = 6,            /* ival: live */
  PYSHIM_QUERY_SERVER_READY = 7,    /* ival: ready */
  PYSHIM_QUERY_SERVER_METADATA = 8, /* sval: JSON */
  PYSHIM_QUERY_INDEX = 9,           /* version: index flags; sval: JSON array */
  PYSHIM_QUERY_STATISTICS = 10,     /* sval: {"model_stats": [...]} */
  PYSHIM_QUERY_METRICS = 11,        /* sval: Prometheus text */
  PYSHIM_QUERY_LOAD = 12,
  PYSHIM_QUERY_UNLOAD = 13,
  PYSHIM_QUERY_UNLOAD_DEPENDENTS = 14
};

typedef struct pyshim_result {
  int64_t ival;
  char* sval;
  int32_t err_code; /* -1: success */
  char* err_msg;
} pyshim_result;

typedef struct pyshim_callbacks {
  /* Log line from a backend. */
  void (*log)(int32_t level, const char* file, int32_t line, const char* msg);
  /* A response (or only flags) for the pyserve request 'key'. Ownership of every
   * outputs[i].buffer passes to Python, which frees it with pyshim_free; the rest of the
   * arrays is only valid during the call. err_code < 0 means no error. */
  void (*response)(uint64_t key, uint32_t flags, int32_t has_response, uint32_t output_count,
                   pyshim_output_desc* outputs, uint32_t param_count, pyshim_param* params,
                   int32_t err_code, const char* err_msg);
  /* Request life events: PYSHIM_EVENT_RELEASED (flags = release flags; the input buffers
   * may be dropped) and PYSHIM_EVENT_DONE (no request, factory or response refers to the
   * request any more: nothing more can be sent for it). */
  void (*request_event)(uint64_t key, int32_t event, uint32_t flags);
  int32_t (*is_cancelled)(uint64_t key);
  /* BLS: a TRITONSERVER_InferenceRequest was handed to TRITONSERVER_ServerInferAsync.
   * Returns 0 when Python took it (responses follow through pyshim_ireq_respond). */
  int32_t (*infer_async)(uint64_t server, TRITONSERVER_InferenceRequest* request);
  /* Model queries for BLS callers (PYSHIM_QUERY_*); the answer goes into 'result'. */
  int32_t (*server_query)(uint64_t server, int32_t op, const char* model, int64_t version,
                          pyshim_result* result);
  /* A backend reported a custom trace activity for the traced pyserve request 'key'
   * (timestamp: steady-clock ns, as Triton's). */
  void (*trace_activity)(uint64_t key, uint64_t timestamp_ns, const char* name);
  /* A new trace id from pyserve's tracing (TraceNew, SpawnChildTrace). */
  uint64_t (*trace_id)(void);
} pyshim_callbacks;

INTERNAL extern pyshim_callbacks g_cb;
INTERNAL extern int g_log_verbose;

/* ---- requests and responses ---------------------------------------------------------- */
/* Shared by a request, its response factories and its responses. When the last reference
 * goes, Python learns (PYSHIM_EVENT_DONE) that nothing more can be sent for 'key'. */
typedef struct pyshim_core {
  atomic_int refs;
  uint64_t key;
  TRITONSERVER_InferenceTrace* trace; /* set when pyserve traces the request; freed with the core */
} pyshim_core;
INTERNAL pyshim_core* shim_core_ref(pyshim_core* core);
INTERNAL void shim_core_unref(pyshim_core* core);

struct TRITONBACKEND_Input {
  char* name;
  TRITONSERVER_DataType datatype;
  int64_t* shape;
  uint32_t dims_count;
  uint64_t byte_size;
  const void* buffer; /* borrowed from Python (a numpy array kept alive until release) */
  TRITONSERVER_BufferAttributes attributes;
};

struct TRITONBACKEND_Request {
  pyshim_core* core;
  TRITONBACKEND_ModelInstance* instance;
  char* id;
  uint64_t correlation_id;
  char* correlation_id_string; /* non-NULL when the correlation id is a string */
  uint32_t flags;
  uint64_t timeout_us;
  uint32_t input_count;
  TRITONBACKEND_Input* inputs;
  uint32_t output_count;
  char** outputs;
  uint32_t param_count;
  pyshim_param* params;
};

struct TRITONBACKEND_Output {
  char* name;
  TRITONSERVER_DataType datatype;
  int64_t* shape;
  uint32_t dims_count;
  void* buffer; /* malloc'd by OutputBuffer; owned by the output until sent */
  uint64_t byte_size;
  TRITONSERVER_BufferAttributes attributes;
};

struct TRITONBACKEND_Response {
  pyshim_core* core;
  uint32_t output_count, output_capacity;
  TRITONBACKEND_Output** outputs;
  uint32_t param_count;
  pyshim_param* params;
};

struct TRITONBACKEND_ResponseFactory {
  pyshim_core* core;
};

/* ---- backend / model / instance ------------------------------------------------------- */
typedef struct pyshim_stats {
  uint64_t success_count, failure_count;
  uint64_t compute_input_ns, compute_infer_ns, compute_output_ns;
  uint64_t execution_count, inference_count;
  uint64_t batch_compute_input_ns, batch_compute_infer_ns, batch_compute_output_ns;
} pyshim_stats;

/* One ModelInstanceReport(Batch)Statistics call, kept until Python takes it after the
 * execute (pyshim_instance_take_reports). 'key' is the request's pyserve key (0 for a batch
 * report, whose 'success' is its batch size). */
typedef struct pyshim_report {
  uint64_t key, success;
  uint64_t exec_start_ns, compute_start_ns, compute_end_ns, exec_end_ns;
} pyshim_report;

struct TRITONBACKEND_Backend {
  char* name;
  TRITONSERVER_Message* config;
  char* artifacts;
  void* state;
  TRITONBACKEND_ExecutionPolicy policy;
};

struct TRITONBACKEND_Model {
  char* name;
  uint64_t version;
  char* repository;
  TRITONBACKEND_Backend* backend;
  char* config_json;
  bool auto_complete;
  bool in_initialize; /* ModelSetConfig is only allowed during ModelInitialize */
  bool config_changed;
  void* state;
  TRITONSERVER_Server* server;
  atomic_flag stats_lock;
  pyshim_stats stats;
};

struct TRITONBACKEND_ModelInstance {
  char* name;
  TRITONSERVER_InstanceGroupKind kind;
  int32_t device_id;
  TRITONBACKEND_Model* model;
  void* state;
  atomic_flag reports_lock;
  pyshim_report* reports; /* per-request reports since the last take */
  uint32_t report_count, report_cap;
  pyshim_report batch_report; /* the last batch report since the last take (key 0) */
  bool has_batch_report;
};

struct TRITONBACKEND_BackendAttribute {
  bool parallel_instance_loading;
};

/* ---- traces ---------------------------------------------------------------------------- *
 * A trace is one of three kinds:
 *  - a request trace: pyserve traces a request it hands to a backend; TRITONBACKEND_RequestTrace
 *    returns it; it belongs to the request (freed with its core) and reports custom
 *    activities to pyserve (key = the request's key);
 *  - a user trace (TRITONSERVER_InferenceTrace(Tensor)New): the backend's own callbacks;
 *  - a child (TRITONSERVER_InferenceTraceSpawnChildTrace): the caller owns it until it gives it
 *    to TRITONSERVER_ServerInferAsync; a child of a user trace has its parent's callbacks.
 * A trace given to TRITONSERVER_ServerInferAsync belongs to the server until pyshim_trace_release
 * (the release callback returns a user trace to its owner; a child without one is freed). */
struct TRITONSERVER_InferenceTrace {
  uint64_t key; /* request traces: the pyserve request's key; 0 otherwise */
  uint64_t id, parent_id;
  uint32_t level; /* TRITONSERVER_InferenceTraceLevel bits */
  char* model_name;
  int64_t model_version;
  char* request_id;
  char* context; /* JSON text (OpenTelemetry: {"traceparent": ...}) or NULL */
  TRITONSERVER_InferenceTraceActivityFn_t activity_fn;
  TRITONSERVER_InferenceTraceTensorActivityFn_t tensor_activity_fn;
  TRITONSERVER_InferenceTraceReleaseFn_t release_fn;
  void* userp;
};
INTERNAL void shim_trace_free(TRITONSERVER_InferenceTrace* trace);
EXPORT void pyshim_trace_release(TRITONSERVER_InferenceTrace* trace);
/* Reports one tensor to a user trace's tensor callback (when it has one and traces tensors). */
INTERNAL void shim_trace_tensor(
    TRITONSERVER_InferenceTrace* trace, TRITONSERVER_InferenceTraceActivity activity,
    const char* name, TRITONSERVER_DataType datatype, const void* base, size_t byte_size,
    const int64_t* shape, uint64_t dim_count);

/* A server query through g_cb.server_query; 'res' holds the answer on success (free
 * res->sval). Returns a new error the caller owns on failure. */
INTERNAL TRITONSERVER_Error* shim_query(
    TRITONSERVER_Server* server, int32_t op, const char* model, int64_t version, pyshim_result* res);

/* One per pyserve server; 'key' tells Python which server a BLS call goes to. */
struct TRITONSERVER_Server {
  uint64_t key;
};
INTERNAL extern TRITONSERVER_Server g_server;

#endif /* PYSERVE_SHIM_INTERNAL_H */
