//! The one connection a Redis store shares between its calls, and what a failed call
//! does to it.

use redis::{aio::MultiplexedConnection, FromRedisValue, RedisResult};

use std::{
    sync::{Mutex, PoisonError},
    time::Duration,
};

use super::scripts::Invocation;
use crate::store::error::StoreError;
use deadpool_redis::Pool;

/// One connection, taken from the pool and shared by every call: redis-rs pipelines
/// concurrent commands over it, where checking a connection out for each call would cost
/// a round trip of its own (deadpool-redis checks every connection it hands out with a
/// `PING`). One whose call failed or stalled is not used again.
pub(super) struct SharedConnection {
    pool: Pool,
    shared: Mutex<Shared>,
}

impl SharedConnection {
    pub(super) fn new(pool: Pool) -> Self {
        Self {
            pool,
            shared: Mutex::default(),
        }
    }

    /// The pool's state, for `Debug`.
    pub(super) fn status(&self) -> deadpool_redis::Status {
        self.pool.status()
    }

    /// Sends a command on the shared connection. A connection that broke since its last use
    /// (the server restarted, say) fails the first command sent on it: then the command
    /// runs once more on a new one. Every command here is idempotent for its caller (a
    /// script acquiring again rewrites the same hold, and at worst takes one more fencing
    /// number; a plain pass sent again finds its own keys taken, and leaves them to the
    /// script, which enters them as this very hold; an answer is stored only where none
    /// is), so running one twice is harmless.
    pub(super) async fn send<T: FromRedisValue>(
        &self,
        command: Command<'_>,
    ) -> Result<T, StoreError> {
        let mut call = self.call().await?;
        let result = command.send_on(&mut call.connection).await;
        match result {
            Err(error) if call.reused && broken(&error) => {
                drop(call);
                let mut call = self.call().await?;
                let result = command.send_on(&mut call.connection).await;
                call.end(result)
            }
            result => call.end(result),
        }
    }

    /// A connection of its own for one call, from the pool (deadpool-redis checks it with a
    /// `PING` first), back to the pool when dropped: for a call that blocks its connection
    /// (`WAIT`), which on the shared one would hold up every other call of the process.
    pub(super) async fn dedicated(&self) -> Result<deadpool_redis::Connection, StoreError> {
        let mut connection = self.pool.get().await.map_err(StoreError::not_sent)?;
        // As for the shared connection: the caller bounds the call.
        connection.set_response_timeout(Duration::from_secs(3600));
        Ok(connection)
    }

    /// The shared connection for one call, taken from the pool if there is none.
    pub(super) async fn call(&self) -> Result<Call<'_>, StoreError> {
        let cached = self.shared().connection.clone();
        let reused = cached.is_some();
        let (connection, generation) = match cached {
            Some(cached) => cached,
            None => {
                let pooled = self.pool.get().await.map_err(StoreError::not_sent)?;
                let mut connection = deadpool_redis::Connection::take(pooled);
                // Every call is bounded by the caller (the layer's store timeout,
                // Redlock's per-master timeout), and a call cut short retires the
                // connection. Its own limit (500 ms in redis-rs by default) would refuse a
                // big batch that the store timeout allows.
                connection.set_response_timeout(Duration::from_secs(3600));
                let mut shared = self.shared();
                shared.generation += 1;
                shared.connection = Some((connection.clone(), shared.generation));
                (connection, shared.generation)
            }
        };
        Ok(Call {
            connection,
            generation,
            reused,
            store: self,
            ended: false,
        })
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        // Every change is one assignment: a poisoned state is still whole.
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stops sharing the connection of `generation`, if it is still the shared one.
    fn forget(&self, generation: u64) {
        let mut shared = self.shared();
        if shared
            .connection
            .as_ref()
            .is_some_and(|(_, g)| *g == generation)
        {
            shared.connection = None;
        }
    }
}

/// The shared connection, and which one it is: connections are replaced, and a late failure
/// of an old one must not throw away its successor.
#[derive(Default)]
struct Shared {
    connection: Option<(MultiplexedConnection, u64)>,
    generation: u64,
}

/// What one call sends.
#[derive(Clone, Copy)]
pub(super) enum Command<'a> {
    Script(&'a Invocation),
    /// Plain commands, sent together (a big batch's free keys).
    Pipeline(&'a redis::Pipeline),
    /// A plain command (the idempotency layer's answers need no script).
    #[cfg(feature = "idempotency")]
    Plain(&'a redis::Cmd),
}

impl Command<'_> {
    pub(super) async fn send_on<T: FromRedisValue>(
        self,
        connection: &mut MultiplexedConnection,
    ) -> RedisResult<T> {
        match self {
            Self::Script(script) => script.invoke(connection).await,
            Self::Pipeline(pipeline) => pipeline.query_async(connection).await,
            #[cfg(feature = "idempotency")]
            Self::Plain(command) => command.query_async(connection).await,
        }
    }
}

/// One call on the shared connection. If the call fails with the connection (not with an
/// answer from Redis), or is dropped before it ends (a timeout around it gave up), the
/// connection may be broken or stalled, and the next call takes a new one from the pool.
pub(super) struct Call<'a> {
    pub(super) connection: MultiplexedConnection,
    generation: u64,
    /// Whether the connection served calls before this one.
    reused: bool,
    store: &'a SharedConnection,
    ended: bool,
}

impl Call<'_> {
    pub(super) fn end<T>(mut self, result: RedisResult<T>) -> Result<T, StoreError> {
        self.ended = match &result {
            Ok(_) => true,
            Err(error) => !(broken(error) || error.is_timeout()),
        };
        result.map_err(StoreError::unknown)
    }
}

/// An error of the connection rather than an answer from Redis.
fn broken(error: &redis::RedisError) -> bool {
    error.is_unrecoverable_error() || error.is_connection_dropped() || error.is_io_error()
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.store.forget(self.generation);
        }
    }
}
