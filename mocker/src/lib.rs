//! kvroute's mocker: simulated inference workers.
//!
//! The core is sans-I/O: [`cache::KvCache`] and [`engine::Engine`] are state machines driven by
//! simulated time passed in as an argument; the process shells map them onto real time:
//! [`fleet`] (the `kvroute-mocker` process's kvroute-native workers, on NATS and etcd) and
//! [`engine_face`] (workers impersonating vLLM / SGLang engines for the bridge). The evaluation
//! lab (`kvroute-lab`: replay, simulation, trace generation) drives the same engines.

pub mod cache;
pub mod engine;
pub mod engine_face;
pub mod fleet;
pub mod realtime;
pub mod shared_store;

pub use cache::{Admission, CacheConfig, CacheError, KvCache};
pub use engine::{
    Engine, EngineConfig, EngineLoad, EngineOutput, InvalidEngineConfig, Ready, SimRequest,
    SubmitError,
};
