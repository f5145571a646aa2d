/* Test backend "iterative": for models with sequence_batching { iterative_sequence: true }.
 * A request asks for INPUT (INT32) iterations: the backend counts the executes it saw per
 * correlation id and releases the request with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE (no
 * response) until the count is reached; then OUTPUT = the count, and the request is released. */
#include <pthread.h>

#include "backend_util.h"

#define SLOTS 64
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t ids[SLOTS];
static int32_t counts[SLOTS];
static bool used[SLOTS];

static int32_t count_one(uint64_t id) {
  pthread_mutex_lock(&lock);
  int slot = -1, free_slot = -1;
  for (int i = 0; i < SLOTS; i++) {
    if (used[i] && ids[i] == id) slot = i;
    if (!used[i] && free_slot < 0) free_slot = i;
  }
  if (slot < 0) {
    slot = free_slot;
    used[slot] = true;
    ids[slot] = id;
    counts[slot] = 0;
  }
  int32_t count = ++counts[slot];
  pthread_mutex_unlock(&lock);
  return count;
}

static void forget(uint64_t id) {
  pthread_mutex_lock(&lock);
  for (int i = 0; i < SLOTS; i++)
    if (used[i] && ids[i] == id) used[i] = false;
  pthread_mutex_unlock(&lock);
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests, const uint32_t count) {
  (void)instance;
  for (uint32_t r = 0; r < count; r++) {
    TRITONBACKEND_Request* request = requests[r];
    const void* value;
    uint64_t size, id;
    TRITONSERVER_DataType dtype;
    const int64_t* shape;
    uint32_t dims;
    TRITONSERVER_Error* err = input_data(request, "INPUT", &value, &size, &dtype, &shape, &dims);
    if (err == NULL) err = TRITONBACKEND_RequestCorrelationId(request, &id);
    if (err != NULL) {
      send_error(request, err);
      TRITONBACKEND_RequestRelease(request, TRITONSERVER_REQUEST_RELEASE_ALL);
      continue;
    }
    int32_t seen = count_one(id);
    if (seen < *(const int32_t*)value) {
      TRITONBACKEND_RequestRelease(request, TRITONSERVER_REQUEST_RELEASE_RESCHEDULE);
      continue;
    }
    forget(id);
    TRITONBACKEND_Response* response;
    err = TRITONBACKEND_ResponseNew(&response, request);
    if (err == NULL) {
      err = add_output(response, "OUTPUT", TRITONSERVER_TYPE_INT32, shape, dims, &seen, sizeof(seen));
      if (err == NULL) err = TRITONBACKEND_ResponseSend(response, TRITONSERVER_RESPONSE_COMPLETE_FINAL, NULL);
      else TRITONBACKEND_ResponseDelete(response);
    }
    if (err != NULL) send_error(request, err);
    TRITONBACKEND_RequestRelease(request, TRITONSERVER_REQUEST_RELEASE_ALL);
  }
  return NULL;
}
