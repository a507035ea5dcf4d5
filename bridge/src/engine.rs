//! One engine's supervisor: health probes, registration (a `WorkerAgent` per incarnation),
//! load reports, and request forwarding. (In progress.)
