/* Test backend "missing": imports a TRITONSERVER function no server provides. */
#include "backend_util.h"

TRITONSERVER_Error* TRITONSERVER_NoSuchFunction(int x);

TRITONSERVER_Error* TRITONBACKEND_Initialize(TRITONBACKEND_Backend* backend) {
  (void)backend;
  return TRITONSERVER_NoSuchFunction(1);
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests, const uint32_t count) {
  (void)instance; (void)requests; (void)count;
  return NULL;
}
