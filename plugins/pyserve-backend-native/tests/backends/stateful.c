/* Test backend "stateful": a running sum per sequence, under the sequence batcher.
 * Control inputs START (INT32 0/1) and CORRID (UINT64) come from the sequence batcher; the
 * backend checks them against the request's flags and correlation id. OUTPUT = sum so far. */
#include <pthread.h>

#include "backend_util.h"

#define SLOTS 64
typedef struct sums {
  pthread_mutex_t lock;
  uint64_t ids[SLOTS];
  int64_t values[SLOTS];
  bool used[SLOTS];
} sums;

TRITONSERVER_Error* TRITONBACKEND_ModelInitialize(TRITONBACKEND_Model* model) {
  sums* s = calloc(1, sizeof(*s));
  pthread_mutex_init(&s->lock, NULL);
  return TRITONBACKEND_ModelSetState(model, s);
}

TRITONSERVER_Error* TRITONBACKEND_ModelFinalize(TRITONBACKEND_Model* model) {
  void* state;
  RETURN_IF_ERROR(TRITONBACKEND_ModelState(model, &state));
  free(state);
  return NULL;
}

static TRITONSERVER_Error* step(sums* s, TRITONBACKEND_Request* request, int32_t* result) {
  const void *start, *corrid, *value;
  uint64_t size;
  TRITONSERVER_DataType dtype;
  const int64_t* shape;
  uint32_t dims;
  RETURN_IF_ERROR(input_data(request, "START", &start, &size, &dtype, &shape, &dims));
  if (dtype != TRITONSERVER_TYPE_INT32) return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INVALID_ARG, "START must be INT32");
  RETURN_IF_ERROR(input_data(request, "CORRID", &corrid, &size, &dtype, &shape, &dims));
  if (dtype != TRITONSERVER_TYPE_UINT64) return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INVALID_ARG, "CORRID must be UINT64");
  RETURN_IF_ERROR(input_data(request, "INPUT", &value, &size, &dtype, &shape, &dims));
  uint64_t id;
  uint32_t flags;
  RETURN_IF_ERROR(TRITONBACKEND_RequestCorrelationId(request, &id));
  RETURN_IF_ERROR(TRITONBACKEND_RequestFlags(request, &flags));
  if (id != *(const uint64_t*)corrid)
    return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INTERNAL, "CORRID input differs from the request's correlation id");
  bool is_start = *(const int32_t*)start != 0;
  if (is_start != ((flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_START) != 0))
    return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INTERNAL, "START input differs from the request flags");
  pthread_mutex_lock(&s->lock);
  int slot = -1, free_slot = -1;
  for (int i = 0; i < SLOTS; i++) {
    if (s->used[i] && s->ids[i] == id) slot = i;
    if (!s->used[i] && free_slot < 0) free_slot = i;
  }
  if (slot < 0) {
    if (!is_start || free_slot < 0) {
      pthread_mutex_unlock(&s->lock);
      return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INVALID_ARG, "sequence not started");
    }
    slot = free_slot;
    s->used[slot] = true;
    s->ids[slot] = id;
  }
  if (is_start) s->values[slot] = 0;
  s->values[slot] += *(const int32_t*)value;
  *result = (int32_t)s->values[slot];
  if (flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_END) s->used[slot] = false;
  pthread_mutex_unlock(&s->lock);
  return NULL;
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests, const uint32_t count) {
  TRITONBACKEND_Model* model;
  RETURN_IF_ERROR(TRITONBACKEND_ModelInstanceModel(instance, &model));
  void* state;
  RETURN_IF_ERROR(TRITONBACKEND_ModelState(model, &state));
  for (uint32_t r = 0; r < count; r++) {
    TRITONBACKEND_Request* request = requests[r];
    int32_t sum = 0;
    TRITONSERVER_Error* err = step(state, request, &sum);
    if (err != NULL) {
      send_error(request, err);
    } else {
      const void* value;
      uint64_t size;
      TRITONSERVER_DataType dtype;
      const int64_t* shape;
      uint32_t dims;
      TRITONBACKEND_Response* response;
      err = input_data(request, "INPUT", &value, &size, &dtype, &shape, &dims);
      if (err == NULL) err = TRITONBACKEND_ResponseNew(&response, request);
      if (err == NULL) {
        err = add_output(response, "OUTPUT", TRITONSERVER_TYPE_INT32, shape, dims, &sum, sizeof(sum));
        if (err == NULL) err = TRITONBACKEND_ResponseSend(response, TRITONSERVER_RESPONSE_COMPLETE_FINAL, NULL);
        else TRITONBACKEND_ResponseDelete(response);
      }
      if (err != NULL) send_error(request, err);
    }
    TRITONBACKEND_RequestRelease(request, TRITONSERVER_REQUEST_RELEASE_ALL);
  }
  return NULL;
}
