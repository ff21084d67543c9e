//! Everything that knows sockets, RESP, r2d2 and Lua: the Redis driver that
//! implements [`crate::lock::transport::Transport`].

pub(crate) mod conn;
pub(crate) mod conn_state;
pub(crate) mod node;
pub(crate) mod notify;
pub(crate) mod poll;
pub(crate) mod resp;
pub(crate) mod scripts;
#[cfg(feature = "tls-rustls")]
pub(crate) mod tls;
pub(crate) mod url;
