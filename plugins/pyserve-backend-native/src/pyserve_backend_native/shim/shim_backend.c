/*
 * TRITONBACKEND_* functions, and the pyshim_* functions Python uses to create the backend,
 * model, instance and request objects a backend receives.
 *
 * Hot paths stay in C: input properties and buffers are read from the request object,
 * output buffers are malloc'd here, and ResponseSend hands the finished outputs to Python
 * in one callback (the buffers' ownership goes with them: they become the response's numpy
 * arrays without a copy).
 */
#define _GNU_SOURCE
#include <stdio.h>

#include "shim_internal.h"

static TRITONBACKEND_MemoryManager* const k_memory_manager =
    (TRITONBACKEND_MemoryManager*)&g_server; /* any stable non-null address */

/* ---- request core ---------------------------------------------------------------------- */
pyshim_core* shim_core_ref(pyshim_core* core) {
  atomic_fetch_add(&core->refs, 1);
  return core;
}

void shim_core_unref(pyshim_core* core) {
  if (atomic_fetch_sub(&core->refs, 1) == 1) {
    uint64_t key = core->key;
    shim_trace_free(core->trace);
    free(core);
    if (g_cb.request_event != NULL) g_cb.request_event(key, PYSHIM_EVENT_DONE, 0);
  }
}

/* ---- version --------------------------------------------------------------------------- */
EXPORT TRITONSERVER_Error* TRITONBACKEND_ApiVersion(uint32_t* major, uint32_t* minor) {
  SHIM_REQUIRE(major != NULL && minor != NULL, "null argument");
  *major = TRITONBACKEND_API_VERSION_MAJOR;
  *minor = TRITONBACKEND_API_VERSION_MINOR;
  return NULL;
}

/* ---- memory manager (CPU only) ----------------------------------------------------- */
EXPORT TRITONSERVER_Error* TRITONBACKEND_MemoryManagerAllocate(
    TRITONBACKEND_MemoryManager* manager, void** buffer, const TRITONSERVER_MemoryType memory_type,
    const int64_t memory_type_id, const uint64_t byte_size) {
  (void)manager;
  (void)memory_type_id;
  SHIM_REQUIRE(buffer != NULL, "null buffer");
  if (memory_type == TRITONSERVER_MEMORY_GPU)
    return shim_error(TRITONSERVER_ERROR_UNSUPPORTED, "GPU memory is not available in pyserve");
  *buffer = malloc(byte_size ? byte_size : 1);
  if (*buffer == NULL)
    return shim_error(TRITONSERVER_ERROR_UNAVAILABLE, "cannot allocate %llu bytes",
                      (unsigned long long)byte_size);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_MemoryManagerFree(
    TRITONBACKEND_MemoryManager* manager, void* buffer, const TRITONSERVER_MemoryType memory_type,
    const int64_t memory_type_id) {
  (void)manager;
  (void)memory_type;
  (void)memory_type_id;
  free(buffer);
  return NULL;
}

/* ---- inputs ----------------------------------------------------------------------------- */
EXPORT TRITONSERVER_Error* TRITONBACKEND_InputProperties(
    TRITONBACKEND_Input* input, const char** name, TRITONSERVER_DataType* datatype,
    const int64_t** shape, uint32_t* dims_count, uint64_t* byte_size, uint32_t* buffer_count) {
  SHIM_REQUIRE(input != NULL, "null input");
  if (name) *name = input->name;
  if (datatype) *datatype = input->datatype;
  if (shape) *shape = input->shape;
  if (dims_count) *dims_count = input->dims_count;
  if (byte_size) *byte_size = input->byte_size;
  if (buffer_count) *buffer_count = 1;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_InputPropertiesForHostPolicy(
    TRITONBACKEND_Input* input, const char* host_policy_name, const char** name,
    TRITONSERVER_DataType* datatype, const int64_t** shape, uint32_t* dims_count,
    uint64_t* byte_size, uint32_t* buffer_count) {
  (void)host_policy_name; /* one host policy: every policy falls back to the same buffers */
  return TRITONBACKEND_InputProperties(input, name, datatype, shape, dims_count, byte_size,
                                       buffer_count);
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_InputBuffer(
    TRITONBACKEND_Input* input, const uint32_t index, const void** buffer,
    uint64_t* buffer_byte_size, TRITONSERVER_MemoryType* memory_type, int64_t* memory_type_id) {
  SHIM_REQUIRE(input != NULL && buffer != NULL, "null argument");
  if (index != 0)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG,
                      "input '%s' has 1 buffer; buffer index %u is out of range", input->name, index);
  *buffer = input->buffer;
  if (buffer_byte_size) *buffer_byte_size = input->byte_size;
  if (memory_type) *memory_type = TRITONSERVER_MEMORY_CPU;
  if (memory_type_id) *memory_type_id = 0;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_InputBufferForHostPolicy(
    TRITONBACKEND_Input* input, const char* host_policy_name, const uint32_t index,
    const void** buffer, uint64_t* buffer_byte_size, TRITONSERVER_MemoryType* memory_type,
    int64_t* memory_type_id) {
  (void)host_policy_name;
  return TRITONBACKEND_InputBuffer(input, index, buffer, buffer_byte_size, memory_type, memory_type_id);
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_InputBufferAttributes(
    TRITONBACKEND_Input* input, const uint32_t index, const void** buffer,
    TRITONSERVER_BufferAttributes** buffer_attributes) {
  SHIM_REQUIRE(input != NULL, "null input");
  if (index != 0)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG,
                      "input '%s' has 1 buffer; buffer index %u is out of range", input->name, index);
  if (buffer) *buffer = input->buffer;
  if (buffer_attributes) *buffer_attributes = &input->attributes;
  return NULL;
}

/* ---- outputs ----------------------------------------------------------------------------- */
EXPORT TRITONSERVER_Error* TRITONBACKEND_OutputBuffer(
    TRITONBACKEND_Output* output, void** buffer, const uint64_t buffer_byte_size,
    TRITONSERVER_MemoryType* memory_type, int64_t* memory_type_id) {
  SHIM_REQUIRE(output != NULL && buffer != NULL, "null argument");
  if (output->buffer != NULL)
    return shim_error(TRITONSERVER_ERROR_ALREADY_EXISTS,
                      "output '%s' already has a buffer", output->name);
  /* 64-byte alignment, like Triton's allocations; at least 1 byte so NULL means failure. */
  size_t rounded = ((size_t)buffer_byte_size + 63u) & ~(size_t)63u;
  output->buffer = aligned_alloc(64, rounded ? rounded : 64);
  if (output->buffer == NULL)
    return shim_error(TRITONSERVER_ERROR_UNAVAILABLE, "cannot allocate %llu bytes for output '%s'",
                      (unsigned long long)buffer_byte_size, output->name);
  output->byte_size = buffer_byte_size;
  output->attributes.byte_size = buffer_byte_size;
  *buffer = output->buffer;
  if (memory_type) *memory_type = TRITONSERVER_MEMORY_CPU;
  if (memory_type_id) *memory_type_id = 0;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_OutputBufferAttributes(
    TRITONBACKEND_Output* output, TRITONSERVER_BufferAttributes** buffer_attributes) {
  SHIM_REQUIRE(output != NULL && buffer_attributes != NULL, "null argument");
  *buffer_attributes = &output->attributes;
  return NULL;
}

/* ---- requests -------------------------------------------------------------------------- */
EXPORT TRITONSERVER_Error* TRITONBACKEND_RequestId(TRITONBACKEND_Request* request, const char** id) {
  SHIM_REQUIRE(request != NULL && id != NULL, "null argument");
  *id = request->id;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_RequestCorrelationId(TRITONBACKEND_Request* request, uint64_t* id) {
  SHIM_REQUIRE(request != NULL && id != NULL, "null argument");
  if (request->correlation_id_string != NULL)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG,
                      "correlation ID in request is not an unsigned int");
  *id = request->correlation_id;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_RequestCorrelationIdString(
    TRITONBACKEND_Request* request, const char** id) {
  SHIM_REQUIRE(request != NULL && id != NULL, "null argument");
  if (request->correlation_id_string == NULL)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "correlation ID in request is not a string");
  *id = request->correlation_id_string;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_RequestFlags(TRITONBACKEND_Request* request, uint32_t* flags) {
  SHIM_REQUIRE(request != NULL && flags != NULL, "null argument");
  *flags = request->flags;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_RequestIsCancelled(TRITONBACKEND_Request* request, bool* is_cancelled) {
  SHIM_REQUIRE(request != NULL && is_cancelled != NULL, "null argument");
  *is_cancelled = g_cb.is_cancelled != NULL && g_cb.is_cancelled(request->core->key) != 0;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_InferenceRequestTimeoutMicroseconds(
    TRITONBACKEND_Request* request, uint64_t* timeout) {
  SHIM_REQUIRE(request != NULL && timeout != NULL, "null argument");
  *timeout = request->timeout_us;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_RequestParameterCount(TRITONBACKEND_Request* request, uint32_t* count) {
  SHIM_REQUIRE(request != NULL && count != NULL, "null argument");
  *count = request->param_count;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_RequestParameter(
    TRITONBACKEND_Request* request, const uint32_t index, const char** key,
    TRITONSERVER_ParameterType* type, const void** vvalue) {
  SHIM_REQUIRE(request != NULL, "null request");
  if (index >= request->param_count)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "out of bounds index %u: request has %u parameters",
                      index, request->param_count);
  const pyshim_param* p = &request->params[index];
  if (key) *key = p->key;
  if (type) *type = (TRITONSERVER_ParameterType)p->type;
  if (vvalue) *vvalue = shim_param_value(p);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_RequestInputCount(TRITONBACKEND_Request* request, uint32_t* count) {
  SHIM_REQUIRE(request != NULL && count != NULL, "null argument");
  *count = request->input_count;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_RequestInputName(
    TRITONBACKEND_Request* request, const uint32_t index, const char** input_name) {
  SHIM_REQUIRE(request != NULL && input_name != NULL, "null argument");
  if (index >= request->input_count)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "out of bounds index %u: request has %u inputs",
                      index, request->input_count);
  *input_name = request->inputs[index].name;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_RequestInput(
    TRITONBACKEND_Request* request, const char* name, TRITONBACKEND_Input** input) {
  SHIM_REQUIRE(request != NULL && name != NULL && input != NULL, "null argument");
  for (uint32_t i = 0; i < request->input_count; i++)
    if (strcmp(request->inputs[i].name, name) == 0) {
      *input = &request->inputs[i];
      return NULL;
    }
  return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "unknown request input name %s", name);
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_RequestInputByIndex(
    TRITONBACKEND_Request* request, const uint32_t index, TRITONBACKEND_Input** input) {
  SHIM_REQUIRE(request != NULL && input != NULL, "null argument");
  if (index >= request->input_count)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "out of bounds index %u: request has %u inputs",
                      index, request->input_count);
  *input = &request->inputs[index];
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_RequestOutputCount(TRITONBACKEND_Request* request, uint32_t* count) {
  SHIM_REQUIRE(request != NULL && count != NULL, "null argument");
  *count = request->output_count;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_RequestOutputName(
    TRITONBACKEND_Request* request, const uint32_t index, const char** output_name) {
  SHIM_REQUIRE(request != NULL && output_name != NULL, "null argument");
  if (index >= request->output_count)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG,
                      "out of bounds index %u: request has %u requested outputs", index,
                      request->output_count);
  *output_name = request->outputs[index];
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_RequestOutputBufferProperties(
    TRITONBACKEND_Request* request, const char* name, size_t* byte_size,
    TRITONSERVER_MemoryType* memory_type, int64_t* memory_type_id) {
  (void)name;
  SHIM_REQUIRE(request != NULL, "null request");
  /* No preallocated output buffers in pyserve: size unknown, CPU preferred. */
  if (byte_size) *byte_size = 0;
  if (memory_type) *memory_type = TRITONSERVER_MEMORY_CPU;
  if (memory_type_id) *memory_type_id = 0;
  return NULL;
}

static void request_free(TRITONBACKEND_Request* request) {
  for (uint32_t i = 0; i < request->input_count; i++) {
    free(request->inputs[i].name);
    free(request->inputs[i].shape);
  }
  free(request->inputs);
  for (uint32_t i = 0; i < request->output_count; i++) free(request->outputs[i]);
  free(request->outputs);
  for (uint32_t i = 0; i < request->param_count; i++) shim_param_clear(&request->params[i]);
  free(request->params);
  free(request->id);
  free(request->correlation_id_string);
  free(request);
}

/* Releases the request: after success every string, shape, input and buffer obtained from
 * it is gone. Python learns (PYSHIM_EVENT_RELEASED) and drops the input arrays. */
EXPORT TRITONSERVER_Error* TRITONBACKEND_RequestRelease(TRITONBACKEND_Request* request, uint32_t release_flags) {
  SHIM_REQUIRE(request != NULL, "null request");
  pyshim_core* core = request->core;
  if (g_cb.request_event != NULL) g_cb.request_event(core->key, PYSHIM_EVENT_RELEASED, release_flags);
  request_free(request);
  shim_core_unref(core);
  return NULL;
}

/* ---- response factories ------------------------------------------------------------- */
EXPORT TRITONSERVER_Error* TRITONBACKEND_ResponseFactoryNew(
    TRITONBACKEND_ResponseFactory** factory, TRITONBACKEND_Request* request) {
  SHIM_REQUIRE(factory != NULL && request != NULL, "null argument");
  TRITONBACKEND_ResponseFactory* f = malloc(sizeof(*f));
  f->core = shim_core_ref(request->core);
  *factory = f;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ResponseFactoryDelete(TRITONBACKEND_ResponseFactory* factory) {
  SHIM_REQUIRE(factory != NULL, "null factory");
  shim_core_unref(factory->core);
  free(factory);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ResponseFactorySendFlags(
    TRITONBACKEND_ResponseFactory* factory, const uint32_t send_flags) {
  SHIM_REQUIRE(factory != NULL, "null factory");
  if (g_cb.response != NULL)
    g_cb.response(factory->core->key, send_flags, 0, 0, NULL, 0, NULL, -1, NULL);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ResponseFactoryIsCancelled(
    TRITONBACKEND_ResponseFactory* factory, bool* is_cancelled) {
  SHIM_REQUIRE(factory != NULL && is_cancelled != NULL, "null argument");
  *is_cancelled = g_cb.is_cancelled != NULL && g_cb.is_cancelled(factory->core->key) != 0;
  return NULL;
}

/* ---- responses ------------------------------------------------------------------------ */
static TRITONBACKEND_Response* response_new(pyshim_core* core) {
  TRITONBACKEND_Response* r = calloc(1, sizeof(*r));
  r->core = shim_core_ref(core);
  return r;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ResponseNew(
    TRITONBACKEND_Response** response, TRITONBACKEND_Request* request) {
  SHIM_REQUIRE(response != NULL && request != NULL, "null argument");
  *response = response_new(request->core);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ResponseNewFromFactory(
    TRITONBACKEND_Response** response, TRITONBACKEND_ResponseFactory* factory) {
  SHIM_REQUIRE(response != NULL && factory != NULL, "null argument");
  *response = response_new(factory->core);
  return NULL;
}

/* Frees the response; output buffers still owned by it (not sent) are freed too. */
static void response_free(TRITONBACKEND_Response* response) {
  for (uint32_t i = 0; i < response->output_count; i++) {
    TRITONBACKEND_Output* o = response->outputs[i];
    free(o->name);
    free(o->shape);
    free(o->buffer);
    free(o);
  }
  free(response->outputs);
  for (uint32_t i = 0; i < response->param_count; i++) shim_param_clear(&response->params[i]);
  free(response->params);
  pyshim_core* core = response->core;
  free(response);
  shim_core_unref(core);
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ResponseDelete(TRITONBACKEND_Response* response) {
  SHIM_REQUIRE(response != NULL, "null response");
  response_free(response);
  return NULL;
}

static TRITONSERVER_Error* response_param(
    TRITONBACKEND_Response* response, const char* name, int32_t type, const char* s, int64_t i,
    bool b, double d) {
  SHIM_REQUIRE(response != NULL && name != NULL, "null argument");
  if (shim_params_add(&response->params, &response->param_count, name, type, s, i, b, d, NULL, 0))
    return shim_error(TRITONSERVER_ERROR_INTERNAL, "out of memory");
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ResponseSetStringParameter(
    TRITONBACKEND_Response* response, const char* name, const char* value) {
  return response_param(response, name, TRITONSERVER_PARAMETER_STRING, value, 0, false, 0);
}
EXPORT TRITONSERVER_Error* TRITONBACKEND_ResponseSetIntParameter(
    TRITONBACKEND_Response* response, const char* name, const int64_t value) {
  return response_param(response, name, TRITONSERVER_PARAMETER_INT, NULL, value, false, 0);
}
EXPORT TRITONSERVER_Error* TRITONBACKEND_ResponseSetBoolParameter(
    TRITONBACKEND_Response* response, const char* name, const bool value) {
  return response_param(response, name, TRITONSERVER_PARAMETER_BOOL, NULL, 0, value, 0);
}
EXPORT TRITONSERVER_Error* TRITONBACKEND_ResponseSetDoubleParameter(
    TRITONBACKEND_Response* response, const char* name, const double value) {
  return response_param(response, name, TRITONSERVER_PARAMETER_DOUBLE, NULL, 0, false, value);
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ResponseOutput(
    TRITONBACKEND_Response* response, TRITONBACKEND_Output** output, const char* name,
    const TRITONSERVER_DataType datatype, const int64_t* shape, const uint32_t dims_count) {
  SHIM_REQUIRE(response != NULL && output != NULL && name != NULL, "null argument");
  SHIM_REQUIRE(shape != NULL || dims_count == 0, "null shape");
  for (uint32_t i = 0; i < response->output_count; i++)
    if (strcmp(response->outputs[i]->name, name) == 0)
      return shim_error(TRITONSERVER_ERROR_ALREADY_EXISTS, "response already has an output '%s'", name);
  if (response->output_count == response->output_capacity) {
    uint32_t cap = response->output_capacity ? response->output_capacity * 2 : 4;
    TRITONBACKEND_Output** grown = realloc(response->outputs, sizeof(*grown) * cap);
    if (grown == NULL) return shim_error(TRITONSERVER_ERROR_INTERNAL, "out of memory");
    response->outputs = grown;
    response->output_capacity = cap;
  }
  TRITONBACKEND_Output* o = calloc(1, sizeof(*o));
  o->name = shim_strdup(name);
  o->datatype = datatype;
  o->dims_count = dims_count;
  o->shape = malloc(sizeof(int64_t) * (dims_count ? dims_count : 1));
  if (dims_count) memcpy(o->shape, shape, sizeof(int64_t) * dims_count);
  o->attributes.memory_type = TRITONSERVER_MEMORY_CPU;
  response->outputs[response->output_count++] = o;
  *output = o;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_InferenceResponseOutput(
    TRITONBACKEND_Response* response, const uint32_t index, const char** name,
    TRITONSERVER_DataType* datatype, const int64_t** shape, uint64_t* dim_count) {
  SHIM_REQUIRE(response != NULL, "null response");
  if (index >= response->output_count)
    return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "out of bounds index %u: response has %u outputs",
                      index, response->output_count);
  TRITONBACKEND_Output* o = response->outputs[index];
  if (name) *name = o->name;
  if (datatype) *datatype = o->datatype;
  if (shape) *shape = o->shape;
  if (dim_count) *dim_count = o->dims_count;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_InferenceResponseOutputByName(
    TRITONBACKEND_Response* response, const char* name, TRITONSERVER_DataType* datatype,
    const int64_t** shape, uint64_t* dim_count) {
  SHIM_REQUIRE(response != NULL && name != NULL, "null argument");
  for (uint32_t i = 0; i < response->output_count; i++)
    if (strcmp(response->outputs[i]->name, name) == 0)
      return TRITONBACKEND_InferenceResponseOutput(response, i, NULL, datatype, shape, dim_count);
  return shim_error(TRITONSERVER_ERROR_NOT_FOUND, "response has no output '%s'", name);
}

/* Sends the response: ownership of 'response' passes to the server (do not delete it
 * afterwards); 'error' stays with the caller. The outputs' buffers go to Python as they are. */
EXPORT TRITONSERVER_Error* TRITONBACKEND_ResponseSend(
    TRITONBACKEND_Response* response, const uint32_t send_flags, TRITONSERVER_Error* error) {
  SHIM_REQUIRE(response != NULL, "null response");
  uint32_t n = response->output_count;
  pyshim_output_desc stack_descs[8];
  pyshim_output_desc* descs = n <= 8 ? stack_descs : malloc(sizeof(*descs) * n);
  for (uint32_t i = 0; i < n; i++) {
    TRITONBACKEND_Output* o = response->outputs[i];
    descs[i].name = o->name;
    descs[i].datatype = (int32_t)o->datatype;
    descs[i].dims_count = o->dims_count;
    descs[i].shape = o->shape;
    descs[i].buffer = o->buffer;
    descs[i].byte_size = o->byte_size;
  }
  if (g_cb.response != NULL) {
    /* The buffers now belong to Python (freed there with pyshim_free, even on error). */
    for (uint32_t i = 0; i < n; i++) response->outputs[i]->buffer = NULL;
    g_cb.response(response->core->key, send_flags, 1, n, descs, response->param_count,
                  response->params, error ? (int32_t)error->code : -1,
                  error ? error->message : NULL);
  }
  if (descs != stack_descs) free(descs);
  response_free(response);
  return NULL;
}

/* ---- implicit state: not offered (the sequence batcher passes state as tensors) ------- */
EXPORT TRITONSERVER_Error* TRITONBACKEND_StateNew(
    TRITONBACKEND_State** state, TRITONBACKEND_Request* request, const char* name,
    const TRITONSERVER_DataType datatype, const int64_t* shape, const uint32_t dims_count) {
  (void)state; (void)request; (void)datatype; (void)shape; (void)dims_count;
  return shim_error(TRITONSERVER_ERROR_UNSUPPORTED,
                    "implicit state '%s': TRITONBACKEND_State* is not supported by pyserve; "
                    "the sequence batcher passes state as input/output tensors", name ? name : "");
}
EXPORT TRITONSERVER_Error* TRITONBACKEND_StateUpdate(TRITONBACKEND_State* state) {
  (void)state;
  return shim_error(TRITONSERVER_ERROR_UNSUPPORTED, "implicit state is not supported by pyserve");
}
EXPORT TRITONSERVER_Error* TRITONBACKEND_StateBuffer(
    TRITONBACKEND_State* state, void** buffer, const uint64_t buffer_byte_size,
    TRITONSERVER_MemoryType* memory_type, int64_t* memory_type_id) {
  (void)state; (void)buffer; (void)buffer_byte_size; (void)memory_type; (void)memory_type_id;
  return shim_error(TRITONSERVER_ERROR_UNSUPPORTED, "implicit state is not supported by pyserve");
}
EXPORT TRITONSERVER_Error* TRITONBACKEND_StateBufferAttributes(
    TRITONBACKEND_State* state, TRITONSERVER_BufferAttributes** buffer_attributes) {
  (void)state; (void)buffer_attributes;
  return shim_error(TRITONSERVER_ERROR_UNSUPPORTED, "implicit state is not supported by pyserve");
}

/* ---- backend --------------------------------------------------------------------------- */
EXPORT TRITONSERVER_Error* TRITONBACKEND_BackendName(TRITONBACKEND_Backend* backend, const char** name) {
  SHIM_REQUIRE(backend != NULL && name != NULL, "null argument");
  *name = backend->name;
  return NULL;
}

/* The message belongs to the backend object: the caller must not delete it. */
EXPORT TRITONSERVER_Error* TRITONBACKEND_BackendConfig(
    TRITONBACKEND_Backend* backend, TRITONSERVER_Message** backend_config) {
  SHIM_REQUIRE(backend != NULL && backend_config != NULL, "null argument");
  *backend_config = backend->config;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_BackendExecutionPolicy(
    TRITONBACKEND_Backend* backend, TRITONBACKEND_ExecutionPolicy* policy) {
  SHIM_REQUIRE(backend != NULL && policy != NULL, "null argument");
  *policy = backend->policy;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_BackendSetExecutionPolicy(
    TRITONBACKEND_Backend* backend, TRITONBACKEND_ExecutionPolicy policy) {
  SHIM_REQUIRE(backend != NULL, "null backend");
  backend->policy = policy; /* each instance has its own thread either way */
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_BackendArtifacts(
    TRITONBACKEND_Backend* backend, TRITONBACKEND_ArtifactType* artifact_type, const char** location) {
  SHIM_REQUIRE(backend != NULL, "null backend");
  if (artifact_type) *artifact_type = TRITONBACKEND_ARTIFACT_FILESYSTEM;
  if (location) *location = backend->artifacts;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_BackendMemoryManager(
    TRITONBACKEND_Backend* backend, TRITONBACKEND_MemoryManager** manager) {
  SHIM_REQUIRE(backend != NULL && manager != NULL, "null argument");
  *manager = k_memory_manager;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_BackendState(TRITONBACKEND_Backend* backend, void** state) {
  SHIM_REQUIRE(backend != NULL && state != NULL, "null argument");
  *state = backend->state;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_BackendSetState(TRITONBACKEND_Backend* backend, void* state) {
  SHIM_REQUIRE(backend != NULL, "null backend");
  backend->state = state;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_BackendAttributeAddPreferredInstanceGroup(
    TRITONBACKEND_BackendAttribute* backend_attributes, const TRITONSERVER_InstanceGroupKind kind,
    const uint64_t count, const uint64_t* device_ids, const uint64_t id_count) {
  (void)kind; (void)count; (void)device_ids; (void)id_count;
  SHIM_REQUIRE(backend_attributes != NULL, "null attributes");
  return NULL; /* instance groups come from the config (pyserve fills CPU defaults) */
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_BackendAttributeSetParallelModelInstanceLoading(
    TRITONBACKEND_BackendAttribute* backend_attributes, bool enabled) {
  SHIM_REQUIRE(backend_attributes != NULL, "null attributes");
  backend_attributes->parallel_instance_loading = enabled;
  return NULL;
}

/* ---- model ---------------------------------------------------------------------------- */
EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelName(TRITONBACKEND_Model* model, const char** name) {
  SHIM_REQUIRE(model != NULL && name != NULL, "null argument");
  *name = model->name;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelVersion(TRITONBACKEND_Model* model, uint64_t* version) {
  SHIM_REQUIRE(model != NULL && version != NULL, "null argument");
  *version = model->version;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelRepository(
    TRITONBACKEND_Model* model, TRITONBACKEND_ArtifactType* artifact_type, const char** location) {
  SHIM_REQUIRE(model != NULL, "null model");
  if (artifact_type) *artifact_type = TRITONBACKEND_ARTIFACT_FILESYSTEM;
  if (location) *location = model->repository;
  return NULL;
}

/* A new message the caller owns (TRITONSERVER_MessageDelete). */
EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelConfig(
    TRITONBACKEND_Model* model, const uint32_t config_version, TRITONSERVER_Message** model_config) {
  SHIM_REQUIRE(model != NULL && model_config != NULL, "null argument");
  if (config_version != 1)
    return shim_error(TRITONSERVER_ERROR_UNSUPPORTED,
                      "model configuration version %u not supported, supported versions are: 1",
                      config_version);
  *model_config = shim_message_new(model->config_json);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelAutoCompleteConfig(TRITONBACKEND_Model* model, bool* auto_complete_config) {
  SHIM_REQUIRE(model != NULL && auto_complete_config != NULL, "null argument");
  *auto_complete_config = model->auto_complete;
  return NULL;
}

/* Replaces the model's config (only inside ModelInitialize); the caller keeps 'model_config'. */
EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelSetConfig(
    TRITONBACKEND_Model* model, const uint32_t config_version, TRITONSERVER_Message* model_config) {
  SHIM_REQUIRE(model != NULL && model_config != NULL, "null argument");
  if (config_version != 1)
    return shim_error(TRITONSERVER_ERROR_UNSUPPORTED,
                      "model configuration version %u not supported, supported versions are: 1",
                      config_version);
  if (!model->in_initialize)
    return shim_error(TRITONSERVER_ERROR_UNAVAILABLE,
                      "model '%s': the configuration can only be set during "
                      "TRITONBACKEND_ModelInitialize", model->name);
  free(model->config_json);
  model->config_json = shim_strndup(model_config->json, model_config->size);
  model->config_changed = true;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelServer(TRITONBACKEND_Model* model, TRITONSERVER_Server** server) {
  SHIM_REQUIRE(model != NULL && server != NULL, "null argument");
  *server = model->server != NULL ? model->server : &g_server;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelBackend(TRITONBACKEND_Model* model, TRITONBACKEND_Backend** backend) {
  SHIM_REQUIRE(model != NULL && backend != NULL, "null argument");
  *backend = model->backend;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelState(TRITONBACKEND_Model* model, void** state) {
  SHIM_REQUIRE(model != NULL && state != NULL, "null argument");
  *state = model->state;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelSetState(TRITONBACKEND_Model* model, void* state) {
  SHIM_REQUIRE(model != NULL, "null model");
  model->state = state;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelReportMemoryUsage(
    TRITONBACKEND_Model* model, TRITONSERVER_BufferAttributes** usage, uint32_t usage_size) {
  (void)usage; (void)usage_size;
  SHIM_REQUIRE(model != NULL, "null model");
  return NULL;
}

/* ---- model instance ------------------------------------------------------------------ */
EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceName(TRITONBACKEND_ModelInstance* instance, const char** name) {
  SHIM_REQUIRE(instance != NULL && name != NULL, "null argument");
  *name = instance->name;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceKind(
    TRITONBACKEND_ModelInstance* instance, TRITONSERVER_InstanceGroupKind* kind) {
  SHIM_REQUIRE(instance != NULL && kind != NULL, "null argument");
  *kind = instance->kind;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceDeviceId(TRITONBACKEND_ModelInstance* instance, int32_t* device_id) {
  SHIM_REQUIRE(instance != NULL && device_id != NULL, "null argument");
  *device_id = instance->device_id;
  return NULL;
}

/* A new message the caller owns: the instance's host policy ({"<name>": {...}}). */
EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceHostPolicy(
    TRITONBACKEND_ModelInstance* instance, TRITONSERVER_Message** host_policy) {
  SHIM_REQUIRE(instance != NULL && host_policy != NULL, "null argument");
  *host_policy = shim_message_new(instance->kind == TRITONSERVER_INSTANCEGROUPKIND_GPU ? "{\"gpu_0\":{}}" : "{\"cpu\":{}}");
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceIsPassive(TRITONBACKEND_ModelInstance* instance, bool* is_passive) {
  SHIM_REQUIRE(instance != NULL && is_passive != NULL, "null argument");
  *is_passive = false;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceProfileCount(TRITONBACKEND_ModelInstance* instance, uint32_t* count) {
  SHIM_REQUIRE(instance != NULL && count != NULL, "null argument");
  *count = 0;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceProfileName(
    TRITONBACKEND_ModelInstance* instance, const uint32_t index, const char** profile_name) {
  (void)profile_name;
  SHIM_REQUIRE(instance != NULL, "null instance");
  return shim_error(TRITONSERVER_ERROR_INVALID_ARG, "out of bounds index %u: instance has 0 profiles", index);
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceSecondaryDeviceCount(
    TRITONBACKEND_ModelInstance* instance, uint32_t* count) {
  SHIM_REQUIRE(instance != NULL && count != NULL, "null argument");
  *count = 0;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceSecondaryDeviceProperties(
    TRITONBACKEND_ModelInstance* instance, uint32_t index, const char** kind, int64_t* id) {
  (void)kind; (void)id;
  SHIM_REQUIRE(instance != NULL, "null instance");
  return shim_error(TRITONSERVER_ERROR_INVALID_ARG,
                    "out of bounds index %u: instance has 0 secondary devices", index);
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceModel(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Model** model) {
  SHIM_REQUIRE(instance != NULL && model != NULL, "null argument");
  *model = instance->model;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceState(TRITONBACKEND_ModelInstance* instance, void** state) {
  SHIM_REQUIRE(instance != NULL && state != NULL, "null argument");
  *state = instance->state;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceSetState(TRITONBACKEND_ModelInstance* instance, void* state) {
  SHIM_REQUIRE(instance != NULL, "null instance");
  instance->state = state;
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceReportMemoryUsage(
    TRITONBACKEND_ModelInstance* instance, TRITONSERVER_BufferAttributes** usage, uint32_t usage_size) {
  (void)usage; (void)usage_size;
  SHIM_REQUIRE(instance != NULL, "null instance");
  return NULL;
}

static void stats_lock(TRITONBACKEND_Model* m) {
  while (atomic_flag_test_and_set_explicit(&m->stats_lock, memory_order_acquire)) {
  }
}
static void stats_unlock(TRITONBACKEND_Model* m) {
  atomic_flag_clear_explicit(&m->stats_lock, memory_order_release);
}
static uint64_t span(uint64_t start, uint64_t end) { return end > start ? end - start : 0; }
static void reports_lock(TRITONBACKEND_ModelInstance* i) {
  while (atomic_flag_test_and_set_explicit(&i->reports_lock, memory_order_acquire)) {
  }
}
static void reports_unlock(TRITONBACKEND_ModelInstance* i) {
  atomic_flag_clear_explicit(&i->reports_lock, memory_order_release);
}
#define PYSHIM_MAX_REPORTS 65536u /* a backend that reports without executes cannot grow it further */

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceReportStatistics(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request* request, const bool success,
    const uint64_t exec_start_ns, const uint64_t compute_start_ns, const uint64_t compute_end_ns,
    const uint64_t exec_end_ns) {
  SHIM_REQUIRE(instance != NULL && request != NULL, "null argument");
  TRITONBACKEND_Model* m = instance->model;
  stats_lock(m);
  if (success) {
    m->stats.success_count++;
    m->stats.compute_input_ns += span(exec_start_ns, compute_start_ns);
    m->stats.compute_infer_ns += span(compute_start_ns, compute_end_ns);
    m->stats.compute_output_ns += span(compute_end_ns, exec_end_ns);
  } else {
    m->stats.failure_count++;
  }
  stats_unlock(m);
  pyshim_report r = {request->core ? request->core->key : 0, success, exec_start_ns, compute_start_ns,
                     compute_end_ns, exec_end_ns};
  reports_lock(instance);
  if (instance->report_count == instance->report_cap && instance->report_cap < PYSHIM_MAX_REPORTS) {
    uint32_t cap = instance->report_cap ? instance->report_cap * 2 : 16;
    pyshim_report* grown = realloc(instance->reports, cap * sizeof(*grown));
    if (grown != NULL) {
      instance->reports = grown;
      instance->report_cap = cap;
    }
  }
  if (instance->report_count < instance->report_cap) instance->reports[instance->report_count++] = r;
  reports_unlock(instance);
  return NULL;
}

EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceReportBatchStatistics(
    TRITONBACKEND_ModelInstance* instance, const uint64_t batch_size, const uint64_t exec_start_ns,
    const uint64_t compute_start_ns, const uint64_t compute_end_ns, const uint64_t exec_end_ns) {
  SHIM_REQUIRE(instance != NULL, "null instance");
  TRITONBACKEND_Model* m = instance->model;
  stats_lock(m);
  m->stats.execution_count++;
  m->stats.inference_count += batch_size;
  m->stats.batch_compute_input_ns += span(exec_start_ns, compute_start_ns);
  m->stats.batch_compute_infer_ns += span(compute_start_ns, compute_end_ns);
  m->stats.batch_compute_output_ns += span(compute_end_ns, exec_end_ns);
  stats_unlock(m);
  reports_lock(instance);
  instance->batch_report = (pyshim_report){0, batch_size, exec_start_ns, compute_start_ns, compute_end_ns, exec_end_ns};
  instance->has_batch_report = true;
  reports_unlock(instance);
  return NULL;
}

/* Response statistics (API 1.19): accepted and dropped; pyserve keeps per-request stats. */
struct TRITONBACKEND_ModelInstanceResponseStatistics {
  int unused;
};
EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceResponseStatisticsNew(
    TRITONBACKEND_ModelInstanceResponseStatistics** response_statistics) {
  SHIM_REQUIRE(response_statistics != NULL, "null argument");
  *response_statistics = calloc(1, sizeof(**response_statistics));
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceResponseStatisticsDelete(
    TRITONBACKEND_ModelInstanceResponseStatistics* response_statistics) {
  free(response_statistics);
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceResponseStatisticsSetModelInstance(
    TRITONBACKEND_ModelInstanceResponseStatistics* s, TRITONBACKEND_ModelInstance* instance) {
  (void)s; (void)instance;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceResponseStatisticsSetResponseFactory(
    TRITONBACKEND_ModelInstanceResponseStatistics* s, TRITONBACKEND_ResponseFactory* factory) {
  (void)s; (void)factory;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceResponseStatisticsSetResponseStart(
    TRITONBACKEND_ModelInstanceResponseStatistics* s, uint64_t ns) {
  (void)s; (void)ns;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceResponseStatisticsSetComputeOutputStart(
    TRITONBACKEND_ModelInstanceResponseStatistics* s, uint64_t ns) {
  (void)s; (void)ns;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceResponseStatisticsSetResponseEnd(
    TRITONBACKEND_ModelInstanceResponseStatistics* s, uint64_t ns) {
  (void)s; (void)ns;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceResponseStatisticsSetError(
    TRITONBACKEND_ModelInstanceResponseStatistics* s, TRITONSERVER_Error* error) {
  (void)s; (void)error;
  return NULL;
}
EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceReportResponseStatistics(
    TRITONBACKEND_ModelInstanceResponseStatistics* s) {
  (void)s;
  return NULL;
}

/* ---- host API: objects handed to backends (created and freed by Python) ------------- */
EXPORT TRITONBACKEND_Backend* pyshim_backend_new(const char* name, const char* config_json, const char* artifacts) {
  TRITONBACKEND_Backend* b = calloc(1, sizeof(*b));
  b->name = shim_strdup(name);
  b->config = shim_message_new(config_json);
  b->artifacts = shim_strdup(artifacts);
  return b;
}

EXPORT void pyshim_backend_delete(TRITONBACKEND_Backend* b) {
  if (b == NULL) return;
  free(b->name);
  TRITONSERVER_MessageDelete(b->config);
  free(b->artifacts);
  free(b);
}

EXPORT TRITONSERVER_Server* pyshim_server_new(uint64_t key) {
  TRITONSERVER_Server* s = calloc(1, sizeof(*s));
  s->key = key;
  return s;
}

EXPORT TRITONBACKEND_Model* pyshim_model_new(
    TRITONBACKEND_Backend* backend, TRITONSERVER_Server* server, const char* name, uint64_t version,
    const char* repository, const char* config_json, bool auto_complete) {
  TRITONBACKEND_Model* m = calloc(1, sizeof(*m));
  m->server = server;
  m->name = shim_strdup(name);
  m->version = version;
  m->repository = shim_strdup(repository);
  m->backend = backend;
  m->config_json = shim_strdup(config_json);
  m->auto_complete = auto_complete;
  atomic_flag_clear(&m->stats_lock);
  return m;
}

EXPORT void pyshim_model_set_initializing(TRITONBACKEND_Model* m, bool on) { m->in_initialize = on; }

/* The model's current config JSON (borrowed) and whether the backend replaced it. */
EXPORT const char* pyshim_model_config(TRITONBACKEND_Model* m, bool* changed) {
  if (changed) *changed = m->config_changed;
  return m->config_json;
}

EXPORT void pyshim_model_set_config(TRITONBACKEND_Model* m, const char* config_json) {
  free(m->config_json);
  m->config_json = shim_strdup(config_json);
  m->config_changed = false;
}

EXPORT void pyshim_model_stats(TRITONBACKEND_Model* m, pyshim_stats* out) {
  stats_lock(m);
  *out = m->stats;
  stats_unlock(m);
}

EXPORT void pyshim_model_delete(TRITONBACKEND_Model* m) {
  if (m == NULL) return;
  free(m->name);
  free(m->repository);
  free(m->config_json);
  free(m);
}

EXPORT TRITONBACKEND_ModelInstance* pyshim_instance_new(
    TRITONBACKEND_Model* model, const char* name, int32_t kind, int32_t device_id) {
  TRITONBACKEND_ModelInstance* i = calloc(1, sizeof(*i));
  i->name = shim_strdup(name);
  i->kind = (TRITONSERVER_InstanceGroupKind)kind;
  i->device_id = device_id;
  i->model = model;
  atomic_flag_clear(&i->reports_lock);
  return i;
}

/* Moves the reports made since the last call into 'out' (at most 'capacity'; the rest are
 * dropped) and returns how many were moved; the last batch report goes to '*batch' (returns
 * with batch->key == 1 when there was one, else 0). Called by Python after each execute. */
EXPORT uint32_t pyshim_instance_take_reports(
    TRITONBACKEND_ModelInstance* i, pyshim_report* out, uint32_t capacity, pyshim_report* batch) {
  reports_lock(i);
  uint32_t n = i->report_count < capacity ? i->report_count : capacity;
  if (n) memcpy(out, i->reports, n * sizeof(*out));
  i->report_count = 0;
  *batch = i->batch_report;
  batch->key = i->has_batch_report ? 1 : 0;
  i->has_batch_report = false;
  reports_unlock(i);
  return n;
}

EXPORT void pyshim_instance_delete(TRITONBACKEND_ModelInstance* i) {
  if (i == NULL) return;
  free(i->reports);
  free(i->name);
  free(i);
}

EXPORT TRITONBACKEND_BackendAttribute* pyshim_backend_attribute_new(void) {
  return calloc(1, sizeof(TRITONBACKEND_BackendAttribute));
}

/* A request for one pyserve request 'key'. Python owns it until it is passed to
 * ModelInstanceExecute and the execute succeeds; after that the backend owns it and frees it
 * with TRITONBACKEND_RequestRelease. If the execute fails, Python frees it with
 * pyshim_request_delete. 'correlation_id_string' is NULL for numeric correlation ids. */
EXPORT TRITONBACKEND_Request* pyshim_request_new(
    uint64_t key, TRITONBACKEND_ModelInstance* instance, const char* id, uint64_t correlation_id,
    const char* correlation_id_string, uint32_t flags, uint64_t timeout_us, uint32_t input_count,
    uint32_t output_count) {
  TRITONBACKEND_Request* r = calloc(1, sizeof(*r));
  r->core = calloc(1, sizeof(pyshim_core));
  atomic_init(&r->core->refs, 1);
  r->core->key = key;
  r->instance = instance;
  r->id = shim_strdup(id);
  r->correlation_id = correlation_id;
  r->correlation_id_string = correlation_id_string ? shim_strdup(correlation_id_string) : NULL;
  r->flags = flags;
  r->timeout_us = timeout_us;
  r->input_count = input_count;
  r->inputs = calloc(input_count ? input_count : 1, sizeof(TRITONBACKEND_Input));
  r->output_count = output_count;
  r->outputs = calloc(output_count ? output_count : 1, sizeof(char*));
  return r;
}

/* 'buffer' is borrowed: Python keeps it alive until the request is released. */
EXPORT void pyshim_request_set_input(
    TRITONBACKEND_Request* r, uint32_t index, const char* name, int32_t datatype,
    const int64_t* shape, uint32_t dims_count, const void* buffer, uint64_t byte_size) {
  TRITONBACKEND_Input* in = &r->inputs[index];
  in->name = shim_strdup(name);
  in->datatype = (TRITONSERVER_DataType)datatype;
  in->shape = malloc(sizeof(int64_t) * (dims_count ? dims_count : 1));
  if (dims_count) memcpy(in->shape, shape, sizeof(int64_t) * dims_count);
  in->dims_count = dims_count;
  in->buffer = buffer;
  in->byte_size = byte_size;
  in->attributes.memory_type = TRITONSERVER_MEMORY_CPU;
  in->attributes.byte_size = byte_size;
}

EXPORT void pyshim_request_set_output(TRITONBACKEND_Request* r, uint32_t index, const char* name) {
  r->outputs[index] = shim_strdup(name);
}

EXPORT void pyshim_request_add_param(
    TRITONBACKEND_Request* r, const char* key, int32_t type, const char* str, int64_t i, bool b, double d) {
  shim_params_add(&r->params, &r->param_count, key, type, str, i, b, d, NULL, 0);
}

/* Frees a request the backend never took (its execute failed). No release event is sent. */
EXPORT void pyshim_request_delete(TRITONBACKEND_Request* r) {
  pyshim_core* core = r->core;
  request_free(r);
  shim_core_unref(core);
}
