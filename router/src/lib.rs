//! kvroute's router: worker selection over NATS request/reply.
