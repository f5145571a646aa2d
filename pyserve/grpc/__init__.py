"""The gRPC frontend: Triton's ``inference.GRPCInferenceService`` on grpc.aio."""
