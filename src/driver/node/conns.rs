//! A node as the client holds it: its shared state, its pool, the
//! connection its rounds share, and its background thread.

use std::sync::Arc;

use r2d2::Pool;
use scheduled_thread_pool::ScheduledThreadPool;

use crate::driver::conn::Target;
use crate::driver::node::multiplexed::{MultiplexedSlot, Role};
use crate::driver::node::state::{Manager, NodeState, Pooled};

/// A node: its shared state, pool, shared connection and thread. Its
/// background jobs hold it weakly: they stop once the client is gone.
pub(crate) struct Node {
    pub(crate) shared: Arc<NodeState>,
    pub(crate) pool: Pool<Manager>,
    /// The connection this client's rounds share now (see
    /// [`crate::driver::node::multiplexed`]).
    pub(crate) line: Arc<MultiplexedSlot<Pooled>>,
    /// When a connection to multiplex was last started (a checkout found
    /// none idle): for a node timeout after it, rounds take only idle
    /// connections and wait on the pool for none (each failed checkout and
    /// each pool wait starts one), and join the multiplexed connection once it is made.
    pub(crate) line_started: parking_lot::Mutex<Option<std::time::Instant>>,
    /// The client's reader role (shared by its nodes).
    pub(crate) role: Arc<Role<Pooled>>,
    /// Where to connect outside the pool (status queries).
    pub(crate) target: Target,
    /// This node's own background thread: connects and release retries, so
    /// that a node that is slow to connect delays no other node.
    pub(crate) threads: Arc<ScheduledThreadPool>,
}
