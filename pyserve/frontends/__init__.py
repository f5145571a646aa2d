"""The transports: HTTP/REST and gRPC servers, the status page, connection balancing and limits."""
