/* Test backend "newapi": built for a TRITONBACKEND API newer than the server's (1.99). */
#include "backend_util.h"

TRITONSERVER_Error* TRITONBACKEND_Initialize(TRITONBACKEND_Backend* backend) {
  (void)backend;
  uint32_t major, minor;
  RETURN_IF_ERROR(TRITONBACKEND_ApiVersion(&major, &minor));
  if (major != 1 || minor < 99)
    return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_UNSUPPORTED,
                                 "triton backend API version does not support this backend");
  return NULL;
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests, const uint32_t count) {
  (void)instance; (void)requests; (void)count;
  return NULL;
}
