/* Test backend "decoupled": for INPUT0 = [n] (INT32) it sends n responses OUT = [0], [1], ...
 * from a thread of its own through a response factory, then the final flag alone. The
 * request is released before any response is sent. */
#include <pthread.h>

#include "backend_util.h"

typedef struct job {
  TRITONBACKEND_ResponseFactory* factory;
  int32_t count;
} job;

static void* run(void* arg) {
  job* j = arg;
  for (int32_t i = 0; i < j->count; i++) {
    TRITONBACKEND_Response* response;
    if (TRITONBACKEND_ResponseNewFromFactory(&response, j->factory) != NULL) break;
    int64_t shape[1] = {1};
    TRITONSERVER_Error* err = add_output(response, "OUT", TRITONSERVER_TYPE_INT32, shape, 1, &i, sizeof(i));
    if (err != NULL) {
      TRITONSERVER_ErrorDelete(err);
      TRITONBACKEND_ResponseDelete(response);
      break;
    }
    err = TRITONBACKEND_ResponseSend(response, 0, NULL);
    if (err) TRITONSERVER_ErrorDelete(err);
  }
  TRITONSERVER_Error* err = TRITONBACKEND_ResponseFactorySendFlags(j->factory, TRITONSERVER_RESPONSE_COMPLETE_FINAL);
  if (err) TRITONSERVER_ErrorDelete(err);
  TRITONBACKEND_ResponseFactoryDelete(j->factory);
  free(j);
  return NULL;
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests, const uint32_t count) {
  (void)instance;
  for (uint32_t r = 0; r < count; r++) {
    TRITONBACKEND_Request* request = requests[r];
    const void* data;
    uint64_t size;
    TRITONSERVER_DataType dtype;
    const int64_t* shape;
    uint32_t dims;
    TRITONSERVER_Error* err = input_data(request, "INPUT0", &data, &size, &dtype, &shape, &dims);
    if (err == NULL && size < 4) err = TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INVALID_ARG, "INPUT0 is empty");
    if (err != NULL) {
      send_error(request, err);
      TRITONBACKEND_RequestRelease(request, TRITONSERVER_REQUEST_RELEASE_ALL);
      continue;
    }
    job* j = malloc(sizeof(*j));
    j->count = *(const int32_t*)data; /* copied: the request goes away right below */
    TRITONBACKEND_ResponseFactoryNew(&j->factory, request);
    TRITONBACKEND_RequestRelease(request, TRITONSERVER_REQUEST_RELEASE_ALL);
    pthread_t thread;
    pthread_create(&thread, NULL, run, j);
    pthread_detach(thread);
  }
  return NULL;
}
