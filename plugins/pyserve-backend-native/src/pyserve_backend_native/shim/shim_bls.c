/*
 * Calls from a backend to other models of the server (BLS): TRITONSERVER_InferenceRequest,
 * TRITONSERVER_ResponseAllocator, TRITONSERVER_InferenceResponse and the TRITONSERVER_Server*
 * functions.
 *
 * Ownership (Triton's rules): after TRITONSERVER_ServerInferAsync succeeds the server owns
 * the request until it calls the release callback with TRITONSERVER_REQUEST_RELEASE_ALL
 * (after the final response here). Each response handed to the response callback belongs to
 * the callback, which deletes it with TRITONSERVER_InferenceResponseDelete; output buffers
 * come from the request's allocator and go back to it when the response is deleted.
 */
#define _GNU_SOURCE
#include <stdio.h>

#include "shim_internal.h"

typedef struct ireq_input {
  char* name;
  TRITONSERVER_DataType datatype;
  int64_t* shape;
  uint32_t dims_count;
  uint32_t buffer_count, buffer_capacity;
  const void** buffers; /* borrowed from the backend until the request is released */
  size_t* sizes;
} ireq_input;

struct TRITONSERVER_InferenceRequest {
  char* model;
  int64_t version;
  char* id;
  uint32_t flags;
  uint64_t correlation_id;
  char* correlation_id_string;
  uint64_t priority;
  uint64_t timeout_us;
  uint32_t input_count;
  ireq_input* inputs;
  uint32_t output_count;
  char** outputs;
  uint32_t param_count;
  pyshim_param* params;
  atomic_int cancelled;
  TRITONSERVER_InferenceRequestReleaseFn_t release_fn;
  void* release_userp;
  TRITONSERVER_ResponseAllocator* allocator;
  void* allocator_userp;
  TRITONSERVER_InferenceResponseCompleteFn_t response_fn;
  void* response_userp;
  TRITONSERVER_InferenceTrace* trace; /* the server's from ServerInferAsync to the final response */
};

struct TRITONSERVER_ResponseAllocator {
  TRITONSERVER_ResponseAllocatorAllocFn_t alloc_fn;
  TRITONSERVER_ResponseAllocatorReleaseFn_t release_fn;
  TRITONSERVER_ResponseAllocatorStartFn_t start_fn;
  TRITONSERVER_ResponseAllocatorQueryFn_t query_fn;
  TRITONSERVER_ResponseAllocatorBufferAttributesFn_t attributes_fn;
};

typedef struct iresp_output {
  char* name;
  TRITONSERVER_DataType datatype;
  int64_t* shape;
  uint64_t dims_count;
  void* buffer; /* from the allocator */
  void* buffer_userp;
  size_t byte_size;
  TRITONSERVER_MemoryType memory_type;
  int64_t memory_type_id;
} iresp_output;

struct TRITONSERVER_InferenceResponse {
  TRITONSERVER_Error_Code error_code; /* valid when error_message != NULL */
  char* error_message;
  char* id;
  char* model;
  int64_t version;
  uint32_t output_count;
  iresp_output* outputs;
  uint32_t param_count;
  pyshim_param* params;
  TRITONSERVER_ResponseAllocator* allocator;
};

/* ---- allocator -------------------------------------------------------------------------- */
EXPORT TRITONSERVER_Error* TRITONSERVER_ResponseAllocatorNew(
    TRITONSERVER_ResponseAllocator** allocator, TRITONSERVER_ResponseAllocatorAllocFn_t alloc_fn,
    TRITONSERVER_ResponseAllocatorReleaseFn_t release_fn,
    TRITONSERVER_ResponseAllocatorStartFn_t start_fn) {
  SHIM_REQUIRE(allocator != NULL && alloc_fn != NULL && release_fn != NULL, "null argument");
  TRITONSERVER_ResponseAllocator* a = calloc(1, sizeof(*a));
  a->alloc_fn = alloc_fn;
  a->release_fn = release_fn;
  a->start_fn = start_fn;
  *allocator = a;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ResponseAllocatorSetQueryFunction(
    TRITONSERVER_ResponseAllocator* allocator, TRITONSERVER_ResponseAllocatorQueryFn_t query_fn) {
  SHIM_REQUIRE(allocator != NULL, "null allocator");
  allocator->query_fn = query_fn;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ResponseAllocatorSetBufferAttributesFunction(
    TRITONSERVER_ResponseAllocator* allocator,
    TRITONSERVER_ResponseAllocatorBufferAttributesFn_t buffer_attributes_fn) {
  SHIM_REQUIRE(allocator != NULL, "null allocator");
  allocator->attributes_fn = buffer_attributes_fn;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ResponseAllocatorDelete(TRITONSERVER_ResponseAllocator* allocator) {
  free(allocator);
  return NULL;
}

/* ---- inference request ------------------------------------------------------------- */
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestNew(
    TRITONSERVER_InferenceRequest** inference_request, TRITONSERVER_Server* server,
    const char* model_name, const int64_t model_version) {
  (void)server;
  SHIM_REQUIRE(inference_request != NULL && model_name != NULL, "null argument");
  TRITONSERVER_InferenceRequest* r = calloc(1, sizeof(*r));
  r->model = shim_strdup(model_name);
  r->version = model_version;
  r->id = shim_strdup("");
  *inference_request = r;
  return NULL;
}

static void ireq_input_clear(ireq_input* in) {
  free(in->name);
  free(in->shape);
  free(in->buffers);
  free(in->sizes);
  memset(in, 0, sizeof(*in));
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestDelete(TRITONSERVER_InferenceRequest* r) {
  if (r == NULL) return NULL;
  pyshim_trace_release(r->trace); /* only set if it never got its final response */
  for (uint32_t i = 0; i < r->input_count; i++) ireq_input_clear(&r->inputs[i]);
  free(r->inputs);
  for (uint32_t i = 0; i < r->output_count; i++) free(r->outputs[i]);
  free(r->outputs);
  for (uint32_t i = 0; i < r->param_count; i++) shim_param_clear(&r->params[i]);
  free(r->params);
  free(r->model);
  free(r->id);
  free(r->correlation_id_string);
  free(r);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestId(TRITONSERVER_InferenceRequest* r, const char** id) {
  SHIM_REQUIRE(r != NULL && id != NULL, "null argument");
  *id = r->id;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetId(TRITONSERVER_InferenceRequest* r, const char* id) {
  SHIM_REQUIRE(r != NULL, "null request");
  free(r->id);
  r->id = shim_strdup(id);
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestFlags(TRITONSERVER_InferenceRequest* r, uint32_t* flags) {
  SHIM_REQUIRE(r != NULL && flags != NULL, "null argument");
  *flags = r->flags;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetFlags(TRITONSERVER_InferenceRequest* r, uint32_t flags) {
  SHIM_REQUIRE(r != NULL, "null request");
  r->flags = flags;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestCorrelationId(TRITONSERVER_InferenceRequest* r, uint64_t* id) {
  SHIM_REQUIRE(r != NULL && id != NULL, "null argument");
  if (r->correlation_id_string != NULL)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "given request's correlation id is not an unsigned int");
  *id = r->correlation_id;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetCorrelationId(TRITONSERVER_InferenceRequest* r, uint64_t id) {
  SHIM_REQUIRE(r != NULL, "null request");
  free(r->correlation_id_string);
  r->correlation_id_string = NULL;
  r->correlation_id = id;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestCorrelationIdString(
    TRITONSERVER_InferenceRequest* r, const char** id) {
  SHIM_REQUIRE(r != NULL && id != NULL, "null argument");
  if (r->correlation_id_string == NULL)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "given request's correlation id is not a string");
  *id = r->correlation_id_string;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetCorrelationIdString(
    TRITONSERVER_InferenceRequest* r, const char* id) {
  SHIM_REQUIRE(r != NULL && id != NULL, "null argument");
  free(r->correlation_id_string);
  r->correlation_id_string = shim_strdup(id);
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestPriority(TRITONSERVER_InferenceRequest* r, uint32_t* priority) {
  SHIM_REQUIRE(r != NULL && priority != NULL, "null argument");
  *priority = (uint32_t)r->priority;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetPriority(TRITONSERVER_InferenceRequest* r, uint32_t priority) {
  SHIM_REQUIRE(r != NULL, "null request");
  r->priority = priority;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestPriorityUInt64(TRITONSERVER_InferenceRequest* r, uint64_t* priority) {
  SHIM_REQUIRE(r != NULL && priority != NULL, "null argument");
  *priority = r->priority;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetPriorityUInt64(TRITONSERVER_InferenceRequest* r, uint64_t priority) {
  SHIM_REQUIRE(r != NULL, "null request");
  r->priority = priority;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestTimeoutMicroseconds(TRITONSERVER_InferenceRequest* r, uint64_t* timeout_us) {
  SHIM_REQUIRE(r != NULL && timeout_us != NULL, "null argument");
  *timeout_us = r->timeout_us;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetTimeoutMicroseconds(TRITONSERVER_InferenceRequest* r, uint64_t timeout_us) {
  SHIM_REQUIRE(r != NULL, "null request");
  r->timeout_us = timeout_us;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestCancel(TRITONSERVER_InferenceRequest* r) {
  SHIM_REQUIRE(r != NULL, "null request");
  atomic_store(&r->cancelled, 1);
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestIsCancelled(TRITONSERVER_InferenceRequest* r, bool* is_cancelled) {
  SHIM_REQUIRE(r != NULL && is_cancelled != NULL, "null argument");
  *is_cancelled = atomic_load(&r->cancelled) != 0;
  return NULL;
}

static ireq_input* find_input(TRITONSERVER_InferenceRequest* r, const char* name) {
  for (uint32_t i = 0; i < r->input_count; i++)
    if (strcmp(r->inputs[i].name, name) == 0) return &r->inputs[i];
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestAddInput(
    TRITONSERVER_InferenceRequest* r, const char* name, const TRITONSERVER_DataType datatype,
    const int64_t* shape, uint64_t dim_count) {
  SHIM_REQUIRE(r != NULL && name != NULL && (shape != NULL || dim_count == 0), "null argument");
  if (find_input(r, name) != NULL)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "input '%s' already exists in request", name);
  ireq_input* grown = realloc(r->inputs, sizeof(*grown) * (r->input_count + 1));
  if (grown == NULL) return shim_error(TRITONSERVER_ERROR_INTERNAL, "out of memory");
  r->inputs = grown;
  ireq_input* in = &grown[r->input_count++];
  memset(in, 0, sizeof(*in));
  in->name = shim_strdup(name);
  in->datatype = datatype;
  in->dims_count = (uint32_t)dim_count;
  in->shape = malloc(sizeof(int64_t) * (dim_count ? dim_count : 1));
  if (dim_count) memcpy(in->shape, shape, sizeof(int64_t) * dim_count);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestAddRawInput(TRITONSERVER_InferenceRequest* r, const char* name) {
  (void)r;
  return shim_error(TRITONSERVER_ERROR_UNSUPPORTED,
                    "raw input '%s': TRITONSERVER_InferenceRequestAddRawInput is not supported by pyserve",
                    name ? name : "");
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestRemoveInput(TRITONSERVER_InferenceRequest* r, const char* name) {
  SHIM_REQUIRE(r != NULL && name != NULL, "null argument");
  ireq_input* in = find_input(r, name);
  if (in == NULL) return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "input '%s' does not exist in request", name);
  ireq_input_clear(in);
  uint32_t index = (uint32_t)(in - r->inputs);
  memmove(in, in + 1, sizeof(*in) * (r->input_count - index - 1));
  r->input_count--;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestRemoveAllInputs(TRITONSERVER_InferenceRequest* r) {
  SHIM_REQUIRE(r != NULL, "null request");
  for (uint32_t i = 0; i < r->input_count; i++) ireq_input_clear(&r->inputs[i]);
  r->input_count = 0;
  return NULL;
}

/* 'base' is borrowed: it must stay valid until the request is released. */
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestAppendInputData(
    TRITONSERVER_InferenceRequest* r, const char* name, const void* base, size_t byte_size,
    TRITONSERVER_MemoryType memory_type, int64_t memory_type_id) {
  (void)memory_type_id;
  SHIM_REQUIRE(r != NULL && name != NULL && (base != NULL || byte_size == 0), "null argument");
  if (memory_type == TRITONSERVER_MEMORY_GPU)
    return shim_error(TRITONSERVER_ERROR_UNSUPPORTED, "input '%s': GPU memory is not supported by pyserve", name);
  ireq_input* in = find_input(r, name);
  if (in == NULL) return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "input '%s' does not exist in request", name);
  if (in->buffer_count == in->buffer_capacity) {
    uint32_t cap = in->buffer_capacity ? in->buffer_capacity * 2 : 2;
    in->buffers = realloc(in->buffers, sizeof(void*) * cap);
    in->sizes = realloc(in->sizes, sizeof(size_t) * cap);
    in->buffer_capacity = cap;
  }
  in->buffers[in->buffer_count] = base;
  in->sizes[in->buffer_count] = byte_size;
  in->buffer_count++;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestAppendInputDataWithHostPolicy(
    TRITONSERVER_InferenceRequest* r, const char* name, const void* base, size_t byte_size,
    TRITONSERVER_MemoryType memory_type, int64_t memory_type_id, const char* host_policy_name) {
  (void)host_policy_name;
  return TRITONSERVER_InferenceRequestAppendInputData(r, name, base, byte_size, memory_type, memory_type_id);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestAppendInputDataWithBufferAttributes(
    TRITONSERVER_InferenceRequest* r, const char* name, const void* base,
    TRITONSERVER_BufferAttributes* buffer_attributes) {
  SHIM_REQUIRE(buffer_attributes != NULL, "null buffer attributes");
  return TRITONSERVER_InferenceRequestAppendInputData(
      r, name, base, buffer_attributes->byte_size, buffer_attributes->memory_type,
      buffer_attributes->memory_type_id);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestRemoveAllInputData(TRITONSERVER_InferenceRequest* r, const char* name) {
  SHIM_REQUIRE(r != NULL && name != NULL, "null argument");
  ireq_input* in = find_input(r, name);
  if (in == NULL) return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "input '%s' does not exist in request", name);
  in->buffer_count = 0;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestAddRequestedOutput(TRITONSERVER_InferenceRequest* r, const char* name) {
  SHIM_REQUIRE(r != NULL && name != NULL, "null argument");
  for (uint32_t i = 0; i < r->output_count; i++)
    if (strcmp(r->outputs[i], name) == 0) return NULL;
  r->outputs = realloc(r->outputs, sizeof(char*) * (r->output_count + 1));
  r->outputs[r->output_count++] = shim_strdup(name);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestRemoveRequestedOutput(TRITONSERVER_InferenceRequest* r, const char* name) {
  SHIM_REQUIRE(r != NULL && name != NULL, "null argument");
  for (uint32_t i = 0; i < r->output_count; i++)
    if (strcmp(r->outputs[i], name) == 0) {
      free(r->outputs[i]);
      memmove(&r->outputs[i], &r->outputs[i + 1], sizeof(char*) * (r->output_count - i - 1));
      r->output_count--;
      return NULL;
    }
  return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "requested output '%s' does not exist in request", name);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestRemoveAllRequestedOutputs(TRITONSERVER_InferenceRequest* r) {
  SHIM_REQUIRE(r != NULL, "null request");
  for (uint32_t i = 0; i < r->output_count; i++) free(r->outputs[i]);
  r->output_count = 0;
  return NULL;
}

static TRITONSERVER_Error* ireq_param(
    TRITONSERVER_InferenceRequest* r, const char* key, int32_t type, const char* s, int64_t i, bool b, double d) {
  SHIM_REQUIRE(r != NULL && key != NULL, "null argument");
  shim_params_add(&r->params, &r->param_count, key, type, s, i, b, d, NULL, 0);
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetStringParameter(
    TRITONSERVER_InferenceRequest* r, const char* key, const char* value) {
  return ireq_param(r, key, TRITONSERVER_PARAMETER_STRING, value, 0, false, 0);
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetIntParameter(
    TRITONSERVER_InferenceRequest* r, const char* key, const int64_t value) {
  return ireq_param(r, key, TRITONSERVER_PARAMETER_INT, NULL, value, false, 0);
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetBoolParameter(
    TRITONSERVER_InferenceRequest* r, const char* key, const bool value) {
  return ireq_param(r, key, TRITONSERVER_PARAMETER_BOOL, NULL, 0, value, 0);
}
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetDoubleParameter(
    TRITONSERVER_InferenceRequest* r, const char* key, const double value) {
  return ireq_param(r, key, TRITONSERVER_PARAMETER_DOUBLE, NULL, 0, false, value);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetReleaseCallback(
    TRITONSERVER_InferenceRequest* r, TRITONSERVER_InferenceRequestReleaseFn_t release_fn, void* release_userp) {
  SHIM_REQUIRE(r != NULL, "null request");
  r->release_fn = release_fn;
  r->release_userp = release_userp;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetResponseCallback(
    TRITONSERVER_InferenceRequest* r, TRITONSERVER_ResponseAllocator* allocator, void* allocator_userp,
    TRITONSERVER_InferenceResponseCompleteFn_t response_fn, void* response_userp) {
  SHIM_REQUIRE(r != NULL, "null request");
  r->allocator = allocator;
  r->allocator_userp = allocator_userp;
  r->response_fn = response_fn;
  r->response_userp = response_userp;
  return NULL;
}

/* ---- server ------------------------------------------------------------------------------ */
/* Submits a BLS request. The trace (or NULL) is the server's from here on, whatever the outcome
 * (Triton's rule): its activities go to its callbacks (a user trace) or into pyserve's tracing
 * as a child of the calling request's trace, and it is released after the final response. */
EXPORT TRITONSERVER_Error* TRITONSERVER_ServerInferAsync(
    TRITONSERVER_Server* server, TRITONSERVER_InferenceRequest* r, TRITONSERVER_InferenceTrace* trace) {
  if (r == NULL || r->response_fn == NULL || r->release_fn == NULL) {
    pyshim_trace_release(trace);
    if (r == NULL) return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "%s: null request", __func__);
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG,
                      "inference request for model '%s' needs a response callback and a release "
                      "callback before TRITONSERVER_ServerInferAsync", r->model);
  }
  r->trace = trace;
  for (uint32_t i = 0; trace != NULL && i < r->input_count; i++) {
    ireq_input* in = &r->inputs[i];
    for (uint32_t b = 0; b < in->buffer_count; b++)
      shim_trace_tensor(trace, TRITONSERVER_TRACE_TENSOR_QUEUE_INPUT, in->name, in->datatype, in->buffers[b],
                        in->sizes[b], in->shape, in->dims_count);
  }
  if (g_cb.infer_async == NULL || g_cb.infer_async(server ? server->key : 0, r) != 0) {
    r->trace = NULL;
    pyshim_trace_release(trace);
    return shim_error(TRITONSERVER_ERROR_INTERNAL, "pyserve could not submit the request for model '%s'", r->model);
  }
  return NULL;
}

TRITONSERVER_Error* shim_query(
    TRITONSERVER_Server* server, int32_t op, const char* model, int64_t version, pyshim_result* res) {
  memset(res, 0, sizeof(*res));
  res->err_code = -1;
  if (model == NULL) return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "null model name");
  if (g_cb.server_query == NULL) return shim_error(TRITONSERVER_ERROR_UNAVAILABLE, "server is not running");
  g_cb.server_query(server ? server->key : 0, op, model, version, res);
  if (res->err_code >= 0) {
    TRITONSERVER_Error* err = TRITONSERVER_ErrorNew((TRITONSERVER_Error_Code)res->err_code, res->err_msg);
    free(res->err_msg);
    free(res->sval);
    res->sval = NULL;
    return err;
  }
  free(res->err_msg);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerModelIsReady(
    TRITONSERVER_Server* server, const char* model_name, const int64_t model_version, bool* ready) {
  SHIM_REQUIRE(ready != NULL, "null argument");
  pyshim_result res;
  TRITONSERVER_Error* err = shim_query(server, PYSHIM_QUERY_READY, model_name, model_version, &res);
  if (err) return err;
  free(res.sval);
  *ready = res.ival != 0;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerModelTransactionProperties(
    TRITONSERVER_Server* server, const char* model_name, const int64_t model_version,
    uint32_t* txn_flags, void** voidp) {
  pyshim_result res;
  TRITONSERVER_Error* err = shim_query(server, PYSHIM_QUERY_TXN, model_name, model_version, &res);
  if (err) return err;
  free(res.sval);
  if (txn_flags) *txn_flags = (uint32_t)res.ival;
  if (voidp) *voidp = NULL;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerModelBatchProperties(
    TRITONSERVER_Server* server, const char* model_name, const int64_t model_version,
    uint32_t* flags, void** voidp) {
  pyshim_result res;
  TRITONSERVER_Error* err = shim_query(server, PYSHIM_QUERY_BATCH, model_name, model_version, &res);
  if (err) return err;
  free(res.sval);
  if (flags) *flags = (uint32_t)res.ival;
  if (voidp) *voidp = NULL;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerModelConfig(
    TRITONSERVER_Server* server, const char* model_name, const int64_t model_version,
    const uint32_t config_version, TRITONSERVER_Message** model_config) {

  SHIM_REQUIRE(model_config != NULL, "null argument");
  if (config_version != 1)
    return shim_error(TRITONSERVER_ERROR_UNSUPPORTED,
                      "model configuration version %u not supported, supported versions are: 1", config_version);
  pyshim_result res;
  TRITONSERVER_Error* err = shim_query(server, PYSHIM_QUERY_CONFIG, model_name, model_version, &res);
  if (err) return err;
  *model_config = shim_message_new(res.sval ? res.sval : "{}");
  free(res.sval);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_ServerModelMetadata(
    TRITONSERVER_Server* server, const char* model_name, const int64_t model_version,
    TRITONSERVER_Message** model_metadata) {
  SHIM_REQUIRE(model_metadata != NULL, "null argument");
  pyshim_result res;
  TRITONSERVER_Error* err = shim_query(server, PYSHIM_QUERY_METADATA, model_name, model_version, &res);
  if (err) return err;
  *model_metadata = shim_message_new(res.sval ? res.sval : "{}");
  free(res.sval);
  return NULL;
}

/* ---- inference response ------------------------------------------------------------ */
/* Returns a new error the caller owns (NULL when the response succeeded). */
EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceResponseError(TRITONSERVER_InferenceResponse* response) {
  SHIM_REQUIRE(response != NULL, "null response");
  if (response->error_message == NULL) return NULL;
  return TRITONSERVER_ErrorNew(response->error_code, response->error_message);
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceResponseDelete(TRITONSERVER_InferenceResponse* response) {
  if (response == NULL) return NULL;
  for (uint32_t i = 0; i < response->output_count; i++) {
    iresp_output* o = &response->outputs[i];
    if (o->buffer != NULL && response->allocator != NULL) {
      TRITONSERVER_Error* err = response->allocator->release_fn(
          response->allocator, o->buffer, o->buffer_userp, o->byte_size, o->memory_type, o->memory_type_id);
      TRITONSERVER_ErrorDelete(err);
    }
    free(o->name);
    free(o->shape);
  }
  free(response->outputs);
  for (uint32_t i = 0; i < response->param_count; i++) shim_param_clear(&response->params[i]);
  free(response->params);
  free(response->error_message);
  free(response->id);
  free(response->model);
  free(response);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceResponseModel(
    TRITONSERVER_InferenceResponse* response, const char** model_name, int64_t* model_version) {
  SHIM_REQUIRE(response != NULL, "null response");
  if (model_name) *model_name = response->model;
  if (model_version) *model_version = response->version;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceResponseId(TRITONSERVER_InferenceResponse* response, const char** request_id) {
  SHIM_REQUIRE(response != NULL && request_id != NULL, "null argument");
  *request_id = response->id;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceResponseParameterCount(TRITONSERVER_InferenceResponse* response, uint32_t* count) {
  SHIM_REQUIRE(response != NULL && count != NULL, "null argument");
  *count = response->param_count;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceResponseParameter(
    TRITONSERVER_InferenceResponse* response, const uint32_t index, const char** name,
    TRITONSERVER_ParameterType* type, const void** vvalue) {
  SHIM_REQUIRE(response != NULL, "null response");
  if (index >= response->param_count)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "out of bounds index %u: response has %u parameters",
                      index, response->param_count);
  const pyshim_param* p = &response->params[index];
  if (name) *name = p->key;
  if (type) *type = (TRITONSERVER_ParameterType)p->type;
  if (vvalue) *vvalue = shim_param_value(p);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceResponseOutputCount(TRITONSERVER_InferenceResponse* response, uint32_t* count) {
  SHIM_REQUIRE(response != NULL && count != NULL, "null argument");
  *count = response->output_count;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceResponseOutput(
    TRITONSERVER_InferenceResponse* response, const uint32_t index, const char** name,
    TRITONSERVER_DataType* datatype, const int64_t** shape, uint64_t* dim_count, const void** base,
    size_t* byte_size, TRITONSERVER_MemoryType* memory_type, int64_t* memory_type_id, void** userp) {
  SHIM_REQUIRE(response != NULL, "null response");
  if (index >= response->output_count)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "out of bounds index %u: response has %u outputs",
                      index, response->output_count);
  iresp_output* o = &response->outputs[index];
  if (name) *name = o->name;
  if (datatype) *datatype = o->datatype;
  if (shape) *shape = o->shape;
  if (dim_count) *dim_count = o->dims_count;
  if (base) *base = o->buffer;
  if (byte_size) *byte_size = o->byte_size;
  if (memory_type) *memory_type = o->memory_type;
  if (memory_type_id) *memory_type_id = o->memory_type_id;
  if (userp) *userp = o->buffer_userp;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONSERVER_InferenceResponseOutputClassificationLabel(
    TRITONSERVER_InferenceResponse* response, const uint32_t index, const size_t class_index,
    const char** label) {
  (void)index; (void)class_index;
  SHIM_REQUIRE(response != NULL && label != NULL, "null argument");
  *label = NULL; /* no label files through BLS */
  return NULL;
}

/* ---- host API: Python reads a submitted request and answers it ------------------- */
EXPORT void pyshim_ireq_info(
    TRITONSERVER_InferenceRequest* r, const char** model, int64_t* version, const char** id,
    uint32_t* flags, uint64_t* correlation_id, const char** correlation_id_string,
    uint64_t* priority, uint64_t* timeout_us, uint32_t* input_count, uint32_t* output_count,
    uint32_t* param_count) {
  *model = r->model;
  *version = r->version;
  *id = r->id;
  *flags = r->flags;
  *correlation_id = r->correlation_id;
  *correlation_id_string = r->correlation_id_string;
  *priority = r->priority;
  *timeout_us = r->timeout_us;
  *input_count = r->input_count;
  *output_count = r->output_count;
  *param_count = r->param_count;
}

EXPORT void pyshim_ireq_input(
    TRITONSERVER_InferenceRequest* r, uint32_t index, const char** name, int32_t* datatype,
    const int64_t** shape, uint32_t* dims_count, uint32_t* buffer_count) {
  ireq_input* in = &r->inputs[index];
  *name = in->name;
  *datatype = (int32_t)in->datatype;
  *shape = in->shape;
  *dims_count = in->dims_count;
  *buffer_count = in->buffer_count;
}

EXPORT void pyshim_ireq_input_buffer(
    TRITONSERVER_InferenceRequest* r, uint32_t index, uint32_t buffer, const void** base, uint64_t* size) {
  *base = r->inputs[index].buffers[buffer];
  *size = r->inputs[index].sizes[buffer];
}

EXPORT const char* pyshim_ireq_output(TRITONSERVER_InferenceRequest* r, uint32_t index) { return r->outputs[index]; }

EXPORT const pyshim_param* pyshim_ireq_params(TRITONSERVER_InferenceRequest* r) { return r->params; }

EXPORT int32_t pyshim_ireq_is_cancelled(TRITONSERVER_InferenceRequest* r) { return atomic_load(&r->cancelled); }

/* Delivers one response (or only flags) to the backend that submitted 'r'. Output data is
 * copied into buffers from the request's allocator. With TRITONSERVER_RESPONSE_COMPLETE_FINAL
 * the request is released afterwards (release callback, RELEASE_ALL): do not touch 'r' after a
 * final call. err_code < 0 means success. */
EXPORT void pyshim_ireq_respond(
    TRITONSERVER_InferenceRequest* r, uint32_t flags, int32_t has_response, int64_t version,
    int32_t err_code, const char* err_msg, uint32_t output_count, const pyshim_output_desc* outputs,
    uint32_t param_count, const pyshim_param* params) {
  TRITONSERVER_InferenceResponse* resp = NULL;
  if (has_response) {
    resp = calloc(1, sizeof(*resp));
    resp->id = shim_strdup(r->id);
    resp->model = shim_strdup(r->model);
    resp->version = version;
    resp->allocator = r->allocator;
    if (err_code >= 0) {
      resp->error_code = (TRITONSERVER_Error_Code)err_code;
      resp->error_message = shim_strdup(err_msg);
    } else {
      for (uint32_t i = 0; i < param_count; i++)
        shim_params_add(&resp->params, &resp->param_count, params[i].key, params[i].type, params[i].str,
                        params[i].i, params[i].b, params[i].d, params[i].bytes, params[i].size);
      if (output_count) resp->outputs = calloc(output_count, sizeof(iresp_output));
      if (r->allocator != NULL && r->allocator->start_fn != NULL) {
        TRITONSERVER_Error* err = r->allocator->start_fn(r->allocator, r->allocator_userp);
        TRITONSERVER_ErrorDelete(err);
      }
      for (uint32_t i = 0; i < output_count && resp->error_message == NULL; i++) {
        const pyshim_output_desc* d = &outputs[i];
        iresp_output* o = &resp->outputs[resp->output_count++];
        o->name = shim_strdup(d->name);
        o->datatype = (TRITONSERVER_DataType)d->datatype;
        o->dims_count = d->dims_count;
        o->shape = malloc(sizeof(int64_t) * (d->dims_count ? d->dims_count : 1));
        if (d->dims_count) memcpy(o->shape, d->shape, sizeof(int64_t) * d->dims_count);
        o->byte_size = d->byte_size;
        o->memory_type = TRITONSERVER_MEMORY_CPU;
        if (r->allocator == NULL) {
          resp->error_code = TRITONSERVER_ERROR_INTERNAL;
          resp->error_message = shim_strdup("the request has no response allocator");
          break;
        }
        TRITONSERVER_MemoryType actual_type = TRITONSERVER_MEMORY_CPU;
        int64_t actual_id = 0;
        TRITONSERVER_Error* err = r->allocator->alloc_fn(
            r->allocator, d->name, d->byte_size, TRITONSERVER_MEMORY_CPU, 0, r->allocator_userp,
            &o->buffer, &o->buffer_userp, &actual_type, &actual_id);
        if (err != NULL) {
          resp->error_code = err->code;
          resp->error_message = shim_strdup(err->message);
          TRITONSERVER_ErrorDelete(err);
          o->buffer = NULL;
          break;
        }
        o->memory_type = actual_type;
        o->memory_type_id = actual_id;
        if (actual_type == TRITONSERVER_MEMORY_GPU) {
          resp->error_code = TRITONSERVER_ERROR_UNSUPPORTED;
          resp->error_message = shim_strdup("the response allocator returned GPU memory; pyserve has no GPU copy");
          break;
        }
        if (d->byte_size && o->buffer != NULL) memcpy(o->buffer, d->buffer, d->byte_size);
        shim_trace_tensor(r->trace, TRITONSERVER_TRACE_TENSOR_BACKEND_OUTPUT, o->name, o->datatype, o->buffer,
                          o->byte_size, o->shape, o->dims_count);
      }
    }
  }
  TRITONSERVER_InferenceRequestReleaseFn_t release_fn = r->release_fn;
  void* release_userp = r->release_userp;
  if (flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL) { /* the trace is done before the request goes */
    TRITONSERVER_InferenceTrace* trace = r->trace;
    r->trace = NULL;
    pyshim_trace_release(trace);
  }
  r->response_fn(resp, flags, r->response_userp);
  if (flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL) release_fn(r, TRITONSERVER_REQUEST_RELEASE_ALL, release_userp);
}

/* The trace given with the request to ServerInferAsync (NULL without). */
EXPORT TRITONSERVER_InferenceTrace* pyshim_ireq_trace(TRITONSERVER_InferenceRequest* r) { return r->trace; }
