/*
 * TRITONSERVER_InferenceTrace*: the traces of requests pyserve hands to backends (custom
 * activities go to pyserve's tracing: its trace files and OpenTelemetry spans), traces a
 * backend makes for its own BLS requests (TRITONSERVER_InferenceTraceNew: pyserve reports the
 * request's activities to the backend's callbacks), and child traces for BLS requests made
 * while serving a traced request. See shim_internal.h for the kinds and their owners.
 */
#define _GNU_SOURCE
#include <stdio.h>

#include "shim_internal.h"

static TRITONSERVER_InferenceTrace* trace_new(uint64_t key, uint64_t id, uint64_t parent_id, uint32_t level) {
  TRITONSERVER_InferenceTrace* t = calloc(1, sizeof(*t));
  if (t == NULL) return NULL;
  t->key = key;
  t->id = id;
  t->parent_id = parent_id;
  t->level = level;
  t->model_name = shim_strdup("");
  t->request_id = shim_strdup("");
  t->model_version = -1;
  return t;
}

void shim_trace_free(TRITONSERVER_InferenceTrace* trace) {
  if (trace == NULL) return;
  free(trace->model_name);
  free(trace->request_id);
  free(trace->context);
  free(trace);
}

static uint64_t next_trace_id(void) { return g_cb.trace_id != NULL ? g_cb.trace_id() : 0; }

/* ---- enum strings -------------------------------------------------------------------- */
EXPORT const char* TRITONSERVER_InferenceTraceLevelString(TRITONSERVER_InferenceTraceLevel level) {
  switch ((int)level) {
    case TRITONSERVER_TRACE_LEVEL_DISABLED: return "DISABLED";
    case TRITONSERVER_TRACE_LEVEL_MIN: return "MIN";
    case TRITONSERVER_TRACE_LEVEL_MAX: return "MAX";
    case TRITONSERVER_TRACE_LEVEL_TIMESTAMPS: return "TIMESTAMPS";
    case TRITONSERVER_TRACE_LEVEL_TENSORS: return "TENSORS";
  }
  return "<unknown>";
}

EXPORT const char* TRITONSERVER_InferenceTraceActivityString(TRITONSERVER_InferenceTraceActivity activity) {
  static const char* names[] = {"REQUEST_START",       "QUEUE_START",        "COMPUTE_START",
                                "COMPUTE_INPUT_END",   "COMPUTE_OUTPUT_START", "COMPUTE_END",
                                "REQUEST_END",         "TENSOR_QUEUE_INPUT", "TENSOR_BACKEND_INPUT",
                                "TENSOR_BACKEND_OUTPUT", "CUSTOM_ACTIVITY"};
  return (unsigned)activity < sizeof(names) / sizeof(names[0]) ? names[activity] : "<unknown>";
}

/* ---- the trace of a request a backend receives ------------------------------------------- */
/* The request's trace while pyserve traces it (NULL otherwise); it belongs to the request and
 * lives as long as the request or any response factory or response made from it. */
EXPORT TRITONSERVER_Error* TRITONBACKEND_RequestTrace(TRITONBACKEND_Request* request, TRITONSERVER_InferenceTrace** trace) {
  SHIM_REQUIRE(request != NULL && trace != NULL, "null argument");
  *trace = request->core->trace;
  return NULL;
}

/* ---- traces a backend makes ---------------------------------------------------------------- */
static TRITONSERVER_Error* user_trace(
    TRITONSERVER_InferenceTrace** trace, TRITONSERVER_InferenceTraceLevel level, uint64_t parent_id,
    TRITONSERVER_InferenceTraceActivityFn_t activity_fn,
    TRITONSERVER_InferenceTraceTensorActivityFn_t tensor_activity_fn,
    TRITONSERVER_InferenceTraceReleaseFn_t release_fn, void* userp) {
  SHIM_REQUIRE(trace != NULL, "null argument");
  if (release_fn == NULL)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "a trace needs a release function");
  if ((level & (TRITONSERVER_TRACE_LEVEL_MIN | TRITONSERVER_TRACE_LEVEL_MAX | TRITONSERVER_TRACE_LEVEL_TIMESTAMPS))
      && activity_fn == NULL)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "a trace of timestamps needs an activity function");
  if ((level & TRITONSERVER_TRACE_LEVEL_TENSORS) && tensor_activity_fn == NULL)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "a trace of tensors needs a tensor activity function");
  TRITONSERVER_InferenceTrace* t = trace_new(0, next_trace_id(), parent_id, (uint32_t)level);
  if (t == NULL) return shim_error(TRITONSERVER_ERROR_INTERNAL, "out of memory");
  t->activity_fn = activity_fn;
  t->tensor_activity_fn = tensor_activity_fn;
  t->release_fn = release_fn;
  t->userp = userp;
  *trace = t;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceTraceNew(
    TRITONSERVER_InferenceTrace** trace, TRITONSERVER_InferenceTraceLevel level, uint64_t parent_id,
    TRITONSERVER_InferenceTraceActivityFn_t activity_fn, TRITONSERVER_InferenceTraceReleaseFn_t release_fn,
    void* trace_userp) {
  if (level & TRITONSERVER_TRACE_LEVEL_TENSORS)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG,
                      "tensor tracing needs TRITONSERVER_InferenceTraceTensorNew");
  return user_trace(trace, level, parent_id, activity_fn, NULL, release_fn, trace_userp);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceTraceTensorNew(
    TRITONSERVER_InferenceTrace** trace, TRITONSERVER_InferenceTraceLevel level, uint64_t parent_id,
    TRITONSERVER_InferenceTraceActivityFn_t activity_fn,
    TRITONSERVER_InferenceTraceTensorActivityFn_t tensor_activity_fn,
    TRITONSERVER_InferenceTraceReleaseFn_t release_fn, void* trace_userp) {
  return user_trace(trace, level, parent_id, activity_fn, tensor_activity_fn, release_fn, trace_userp);
}

/* Deletes a user or child trace the caller owns; a request's own trace is not the caller's. */
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceTraceDelete(TRITONSERVER_InferenceTrace* trace) {
  if (trace == NULL) return NULL;
  if (trace->key != 0)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG,
                      "the trace of a request belongs to the request and cannot be deleted");
  shim_trace_free(trace);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceTraceSpawnChildTrace(
    TRITONSERVER_InferenceTrace* trace, TRITONSERVER_InferenceTrace** child_trace) {
  SHIM_REQUIRE(trace != NULL && child_trace != NULL, "null argument");
  TRITONSERVER_InferenceTrace* c = trace_new(0, next_trace_id(), trace->id, trace->level);
  if (c == NULL) return shim_error(TRITONSERVER_ERROR_INTERNAL, "out of memory");
  c->context = trace->context != NULL ? shim_strdup(trace->context) : NULL;
  c->activity_fn = trace->activity_fn;
  c->tensor_activity_fn = trace->tensor_activity_fn;
  c->release_fn = trace->release_fn;
  c->userp = trace->userp;
  *child_trace = c;
  return NULL;
}

/* ---- what a trace is about ----------------------------------------------------------------- */
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceTraceId(TRITONSERVER_InferenceTrace* trace, uint64_t* id) {
  SHIM_REQUIRE(trace != NULL && id != NULL, "null argument");
  *id = trace->id;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceTraceParentId(TRITONSERVER_InferenceTrace* trace, uint64_t* parent_id) {
  SHIM_REQUIRE(trace != NULL && parent_id != NULL, "null argument");
  *parent_id = trace->parent_id;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceTraceModelName(TRITONSERVER_InferenceTrace* trace, const char** model_name) {
  SHIM_REQUIRE(trace != NULL && model_name != NULL, "null argument");
  *model_name = trace->model_name;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceTraceModelVersion(TRITONSERVER_InferenceTrace* trace, int64_t* model_version) {
  SHIM_REQUIRE(trace != NULL && model_version != NULL, "null argument");
  *model_version = trace->model_version;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceTraceRequestId(TRITONSERVER_InferenceTrace* trace, const char** request_id) {
  SHIM_REQUIRE(trace != NULL && request_id != NULL, "null argument");
  *request_id = trace->request_id;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceTraceSetContext(TRITONSERVER_InferenceTrace* trace, const char* trace_context) {
  SHIM_REQUIRE(trace != NULL, "null trace");
  free(trace->context);
  trace->context = trace_context != NULL ? shim_strdup(trace_context) : NULL;
  return NULL;
}

/* The trace's context (OpenTelemetry: {"traceparent": "00-<trace>-<span>-01"}); NULL without. */
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceTraceContext(TRITONSERVER_InferenceTrace* trace, const char** trace_context) {
  SHIM_REQUIRE(trace != NULL && trace_context != NULL, "null argument");
  *trace_context = trace->context;
  return NULL;
}

/* ---- custom activities ----------------------------------------------------------------- */
/* A request's trace records the activity in pyserve's trace of the request (a name ending in
 * _START / _END opens / closes a span in OpenTelemetry mode); a user trace passes it to its
 * activity callback as TRITONSERVER_TRACE_CUSTOM_ACTIVITY. */
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceTraceReportActivity(
    TRITONSERVER_InferenceTrace* trace, uint64_t timestamp, const char* activity_name) {
  SHIM_REQUIRE(trace != NULL && activity_name != NULL, "null argument");
  if (activity_name[0] == '\0') return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "empty activity name");
  if (trace->key != 0) {
    if (g_cb.trace_activity != NULL) g_cb.trace_activity(trace->key, timestamp, activity_name);
  } else if (trace->activity_fn != NULL) {
    trace->activity_fn(trace, TRITONSERVER_TRACE_CUSTOM_ACTIVITY, timestamp, trace->userp);
  }
  return NULL;
}

void shim_trace_tensor(
    TRITONSERVER_InferenceTrace* trace, TRITONSERVER_InferenceTraceActivity activity, const char* name,
    TRITONSERVER_DataType datatype, const void* base, size_t byte_size, const int64_t* shape,
    uint64_t dim_count) {
  if (trace == NULL || trace->tensor_activity_fn == NULL || !(trace->level & TRITONSERVER_TRACE_LEVEL_TENSORS))
    return;
  trace->tensor_activity_fn(trace, activity, name, datatype, base, byte_size, shape, dim_count,
                            TRITONSERVER_MEMORY_CPU, 0, trace->userp);
}

/* ---- host API ---------------------------------------------------------------------------- */
/* Traces a request pyserve hands to a backend ('r' owns the trace from now on). */
EXPORT void pyshim_request_set_trace(
    TRITONBACKEND_Request* r, uint64_t id, uint64_t parent_id, const char* model_name, int64_t model_version,
    const char* request_id, const char* context) {
  TRITONSERVER_InferenceTrace* t = trace_new(r->core->key, id, parent_id, TRITONSERVER_TRACE_LEVEL_TIMESTAMPS);
  if (t == NULL) return;
  free(t->model_name);
  t->model_name = shim_strdup(model_name);
  t->model_version = model_version;
  free(t->request_id);
  t->request_id = shim_strdup(request_id);
  t->context = context != NULL ? shim_strdup(context) : NULL;
  shim_trace_free(r->core->trace);
  r->core->trace = t;
}

/* What Python needs to trace a BLS request given a trace (ServerInferAsync). */
EXPORT void pyshim_trace_info(
    TRITONSERVER_InferenceTrace* t, uint64_t* id, uint64_t* parent_id, const char** context, int32_t* callbacks) {
  *id = t->id;
  *parent_id = t->parent_id;
  *context = t->context;
  *callbacks = t->activity_fn != NULL || t->tensor_activity_fn != NULL;
}

/* The model the traced BLS request went to (the trace's model name and version). */
EXPORT void pyshim_trace_set_model(TRITONSERVER_InferenceTrace* t, const char* model_name, int64_t version,
                                   const char* request_id) {
  free(t->model_name);
  t->model_name = shim_strdup(model_name);
  t->model_version = version;
  free(t->request_id);
  t->request_id = shim_strdup(request_id);
}

/* One timestamp of a traced BLS request, to a user trace's activity callback (steady-clock ns). */
EXPORT void pyshim_trace_report(TRITONSERVER_InferenceTrace* t, int32_t activity, uint64_t timestamp_ns) {
  if (t->activity_fn != NULL && (t->level & (TRITONSERVER_TRACE_LEVEL_MIN | TRITONSERVER_TRACE_LEVEL_MAX |
                                             TRITONSERVER_TRACE_LEVEL_TIMESTAMPS)))
    t->activity_fn(t, (TRITONSERVER_InferenceTraceActivity)activity, timestamp_ns, t->userp);
}

/* The server is done with a trace given to ServerInferAsync: a trace with a release callback
 * goes back to its owner through it; one without (a child of a request's trace) is freed. */
EXPORT void pyshim_trace_release(TRITONSERVER_InferenceTrace* t) {
  if (t == NULL) return;
  if (t->release_fn != NULL)
    t->release_fn(t, t->userp);
  else
    shim_trace_free(t);
}
