/* Test backend "bls": for INPUT0 (FP32) it calls the model "ident" through
 * TRITONSERVER_ServerInferAsync and answers OUTPUT0 = 2 * ident(INPUT0). It also counts its
 * calls in a custom metric (bls_calls_total). */
#include <pthread.h>

#include "backend_util.h"

typedef struct call {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  bool released, final;
  TRITONSERVER_InferenceResponse* response;
} call;

typedef struct model_state {
  TRITONSERVER_ResponseAllocator* allocator;
  TRITONSERVER_MetricFamily* family;
  TRITONSERVER_Metric* calls;
} model_state;

static TRITONSERVER_Error* alloc_fn(
    TRITONSERVER_ResponseAllocator* allocator, const char* tensor_name, size_t byte_size,
    TRITONSERVER_MemoryType memory_type, int64_t memory_type_id, void* userp, void** buffer,
    void** buffer_userp, TRITONSERVER_MemoryType* actual_memory_type, int64_t* actual_memory_type_id) {
  (void)allocator; (void)tensor_name; (void)memory_type; (void)memory_type_id; (void)userp;
  *buffer = malloc(byte_size ? byte_size : 1);
  *buffer_userp = NULL;
  *actual_memory_type = TRITONSERVER_MEMORY_CPU;
  *actual_memory_type_id = 0;
  return NULL;
}

static TRITONSERVER_Error* release_fn(
    TRITONSERVER_ResponseAllocator* allocator, void* buffer, void* buffer_userp, size_t byte_size,
    TRITONSERVER_MemoryType memory_type, int64_t memory_type_id) {
  (void)allocator; (void)buffer_userp; (void)byte_size; (void)memory_type; (void)memory_type_id;
  free(buffer);
  return NULL;
}

static void request_released(TRITONSERVER_InferenceRequest* request, const uint32_t flags, void* userp) {
  (void)request;
  call* c = userp;
  if (flags & TRITONSERVER_REQUEST_RELEASE_ALL) {
    pthread_mutex_lock(&c->lock);
    c->released = true;
    pthread_cond_signal(&c->cond);
    pthread_mutex_unlock(&c->lock);
  }
}

static void response_complete(TRITONSERVER_InferenceResponse* response, const uint32_t flags, void* userp) {
  call* c = userp;
  pthread_mutex_lock(&c->lock);
  if (response != NULL) {
    if (c->response != NULL) TRITONSERVER_InferenceResponseDelete(c->response);
    c->response = response;
  }
  if (flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL) c->final = true;
  pthread_cond_signal(&c->cond);
  pthread_mutex_unlock(&c->lock);
}

TRITONSERVER_Error* TRITONBACKEND_ModelInitialize(TRITONBACKEND_Model* model) {
  model_state* s = calloc(1, sizeof(*s));
  RETURN_IF_ERROR(TRITONSERVER_ResponseAllocatorNew(&s->allocator, alloc_fn, release_fn, NULL));
  RETURN_IF_ERROR(TRITONSERVER_MetricFamilyNew(&s->family, TRITONSERVER_METRIC_KIND_COUNTER,
                                               "bls_calls_total", "BLS calls made"));
  const char* name;
  RETURN_IF_ERROR(TRITONBACKEND_ModelName(model, &name));
  TRITONSERVER_Parameter* label = TRITONSERVER_ParameterNew("model", TRITONSERVER_PARAMETER_STRING, name);
  const TRITONSERVER_Parameter* labels[1] = {label};
  TRITONSERVER_Error* err = TRITONSERVER_MetricNew(&s->calls, s->family, labels, 1);
  TRITONSERVER_ParameterDelete(label);
  RETURN_IF_ERROR(err);
  return TRITONBACKEND_ModelSetState(model, s);
}

TRITONSERVER_Error* TRITONBACKEND_ModelFinalize(TRITONBACKEND_Model* model) {
  void* state;
  RETURN_IF_ERROR(TRITONBACKEND_ModelState(model, &state));
  model_state* s = state;
  TRITONSERVER_MetricDelete(s->calls);
  TRITONSERVER_MetricFamilyDelete(s->family);
  TRITONSERVER_ResponseAllocatorDelete(s->allocator);
  free(s);
  return NULL;
}

static TRITONSERVER_Error* infer_one(
    TRITONSERVER_Server* server, model_state* s, TRITONBACKEND_Request* request) {
  bool ready = false;
  RETURN_IF_ERROR(TRITONSERVER_ServerModelIsReady(server, "ident", -1, &ready));
  if (!ready) return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_UNAVAILABLE, "model 'ident' is not ready");
  uint32_t txn = 0;
  RETURN_IF_ERROR(TRITONSERVER_ServerModelTransactionProperties(server, "ident", -1, &txn, NULL));
  if (!(txn & TRITONSERVER_TXN_ONE_TO_ONE))
    return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INTERNAL, "model 'ident' should be one-to-one");

  const void* data;
  uint64_t size;
  TRITONSERVER_DataType dtype;
  const int64_t* shape;
  uint32_t dims;
  RETURN_IF_ERROR(input_data(request, "INPUT0", &data, &size, &dtype, &shape, &dims));

  TRITONSERVER_InferenceRequest* ireq;
  RETURN_IF_ERROR(TRITONSERVER_InferenceRequestNew(&ireq, server, "ident", -1));
  call c = {.released = false, .final = false, .response = NULL};
  pthread_mutex_init(&c.lock, NULL);
  pthread_cond_init(&c.cond, NULL);
  TRITONSERVER_Error* err = TRITONSERVER_InferenceRequestSetId(ireq, "bls-call");
  if (!err) err = TRITONSERVER_InferenceRequestAddInput(ireq, "INPUT0", dtype, shape, dims);
  if (!err) err = TRITONSERVER_InferenceRequestAppendInputData(ireq, "INPUT0", data, size, TRITONSERVER_MEMORY_CPU, 0);
  if (!err) err = TRITONSERVER_InferenceRequestAddRequestedOutput(ireq, "OUTPUT0");
  if (!err) err = TRITONSERVER_InferenceRequestSetReleaseCallback(ireq, request_released, &c);
  if (!err) err = TRITONSERVER_InferenceRequestSetResponseCallback(ireq, s->allocator, NULL, response_complete, &c);
  if (!err) err = TRITONSERVER_ServerInferAsync(server, ireq, NULL);
  if (err) {
    TRITONSERVER_InferenceRequestDelete(ireq);
    return err;
  }
  TRITONSERVER_MetricIncrement(s->calls, 1);
  pthread_mutex_lock(&c.lock);
  while (!(c.released && c.final)) pthread_cond_wait(&c.cond, &c.lock);
  pthread_mutex_unlock(&c.lock);
  TRITONSERVER_InferenceRequestDelete(ireq);
  if (c.response == NULL) return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INTERNAL, "no BLS response");

  err = TRITONSERVER_InferenceResponseError(c.response); /* a new error we own */
  uint32_t outputs = 0;
  if (!err) err = TRITONSERVER_InferenceResponseOutputCount(c.response, &outputs);
  if (!err && outputs != 1) err = TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INTERNAL, "expected one BLS output");
  const char* name;
  TRITONSERVER_DataType out_type;
  const int64_t* out_shape;
  uint64_t out_dims;
  const void* base;
  size_t out_size;
  TRITONSERVER_MemoryType mt;
  int64_t mid;
  void* userp;
  if (!err) err = TRITONSERVER_InferenceResponseOutput(c.response, 0, &name, &out_type, &out_shape, &out_dims,
                                                     &base, &out_size, &mt, &mid, &userp);
  if (!err) {
    float* doubled = malloc(out_size ? out_size : 1);
    for (size_t i = 0; i < out_size / sizeof(float); i++) doubled[i] = 2.0f * ((const float*)base)[i];
    TRITONBACKEND_Response* response;
    err = TRITONBACKEND_ResponseNew(&response, request);
    if (!err) {
      err = add_output(response, "OUTPUT0", out_type, out_shape, (uint32_t)out_dims, doubled, out_size);
      if (!err) err = TRITONBACKEND_ResponseSend(response, TRITONSERVER_RESPONSE_COMPLETE_FINAL, NULL);
      else TRITONBACKEND_ResponseDelete(response);
    }
    free(doubled);
  }
  TRITONSERVER_InferenceResponseDelete(c.response);
  return err;
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests, const uint32_t count) {
  TRITONBACKEND_Model* model;
  RETURN_IF_ERROR(TRITONBACKEND_ModelInstanceModel(instance, &model));
  void* state;
  RETURN_IF_ERROR(TRITONBACKEND_ModelState(model, &state));
  TRITONSERVER_Server* server;
  RETURN_IF_ERROR(TRITONBACKEND_ModelServer(model, &server));
  for (uint32_t r = 0; r < count; r++) {
    TRITONSERVER_Error* err = infer_one(server, state, requests[r]);
    if (err) send_error(requests[r], err);
    TRITONBACKEND_RequestRelease(requests[r], TRITONSERVER_REQUEST_RELEASE_ALL);
  }
  return NULL;
}
