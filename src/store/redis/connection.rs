//! The one connection a Redis store shares between its calls, and what a failed call
//! does to it.

use futures_util::{
    future::{BoxFuture, Shared as SharedFuture},
    FutureExt,
};
use redis::{aio::MultiplexedConnection, FromRedisValue, RedisResult};

use std::{
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use super::scripts::Invocation;
use crate::{observe, store::error::StoreError};
use deadpool_redis::{Pool, PoolError};

/// One connection, taken from the pool and shared by every call: redis-rs pipelines
/// concurrent commands over it, where checking a connection out for each call would cost
/// a round trip of its own (deadpool-redis checks every connection it hands out with a
/// `PING`). One whose call failed or stalled is not used again.
///
/// The next one is made once, for every caller that finds none: in a task of its own,
/// which the callers await, each within its own time, and which goes on when they give
/// up. A stall under load then opens one connection, not one for each caller that timed
/// out (connections taken out of the pool are not counted against its size).
pub(super) struct SharedConnection {
    pool: Pool,
    shared: Mutex<Shared>,
    /// [`Dedicated`] connections between their calls.
    idle: Mutex<Vec<MultiplexedConnection>>,
}

impl SharedConnection {
    pub(super) fn new(pool: Pool) -> Self {
        Self {
            pool,
            shared: Mutex::default(),
            idle: Mutex::default(),
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

    /// A connection of its own for one call that blocks its connection (`WAIT`), which on
    /// the shared one would hold up every other call of the process. It is this store's
    /// own, taken out of the pool: the pool's users (`Redis::pool` takes yours) never get
    /// a connection with this store's settings, or one that a call cut short left busy.
    /// [`Dedicated::done`] keeps it for the next such call; dropped, it is closed.
    pub(super) async fn dedicated(&self) -> Result<Dedicated<'_>, StoreError> {
        // An idle one that still answers, as deadpool-redis checks what it hands out.
        while let Some(mut idle) = self.pop_idle() {
            if redis::cmd("PING")
                .query_async::<()>(&mut idle)
                .await
                .is_ok()
            {
                return Ok(Dedicated {
                    connection: idle,
                    store: self,
                });
            }
        }
        let connection = own_connection(&self.pool)
            .await
            .map_err(StoreError::not_sent)?;
        Ok(Dedicated {
            connection,
            store: self,
        })
    }

    fn pop_idle(&self) -> Option<MultiplexedConnection> {
        self.idle().pop()
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<MultiplexedConnection>> {
        // Every change is one push or pop: a poisoned list is still whole.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The shared connection for one call, taken from the pool if there is none.
    pub(super) async fn call(&self) -> Result<Call<'_>, StoreError> {
        let (connecting, generation) = {
            let mut shared = self.shared();
            if let Some((connection, generation)) = shared.connection.clone() {
                return Ok(self.on(connection, generation, true));
            }
            // None under way, or one that failed while nobody waited for it: a fresh
            // caller makes a new attempt rather than take that old failure.
            let failed = |(attempt, _): &(Connecting, u64)| matches!(attempt.peek(), Some(Err(_)));
            if shared.connecting.as_ref().is_none_or(failed) {
                shared.generation += 1;
                shared.connecting = Some((self.connect(), shared.generation));
            }
            shared.connecting.clone().expect("set above")
        };
        let made = connecting.await;
        let mut shared = self.shared();
        // The first caller to see it made shares it; a failed attempt makes way for the
        // next.
        if shared
            .connecting
            .as_ref()
            .is_some_and(|(_, g)| *g == generation)
        {
            shared.connecting = None;
            if let Ok(connection) = &made {
                shared.connection = Some((connection.clone(), generation));
            }
        }
        drop(shared);
        let connection = made.map_err(StoreError::not_sent)?;
        Ok(self.on(connection, generation, false))
    }

    /// A call on `connection`, of `generation`.
    fn on(&self, connection: MultiplexedConnection, generation: u64, reused: bool) -> Call<'_> {
        Call {
            connection,
            generation,
            reused,
            store: self,
            ended: false,
        }
    }

    /// Makes a connection, in a task that goes on when its callers give up.
    fn connect(&self) -> Connecting {
        let pool = self.pool.clone();
        let made = tokio::spawn(async move {
            observe::connection_opened();
            own_connection(&pool).await.map_err(Arc::new)
        });
        // A task that did not finish: the runtime is shutting down.
        let made = made.map(|joined| joined.unwrap_or(Err(Arc::new(PoolError::Closed))));
        made.boxed().shared()
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

/// A connection of the store's own, taken out of `pool` (never handed back to it).
async fn own_connection(pool: &Pool) -> Result<MultiplexedConnection, PoolError> {
    let mut connection = deadpool_redis::Connection::take(pool.get().await?);
    // Every call is bounded by the caller (the layer's store timeout, Redlock's per-master
    // timeout), and a call cut short retires the connection. Its own limit (500 ms in
    // redis-rs by default) would refuse a big batch that the store timeout allows.
    connection.set_response_timeout(Duration::from_secs(3600));
    Ok(connection)
}

/// The shared connection, and which one it is: connections are replaced, and a late failure
/// of an old one must not throw away its successor.
#[derive(Default)]
struct Shared {
    connection: Option<(MultiplexedConnection, u64)>,
    /// The connection being made, when there is none, and the generation it will be.
    connecting: Option<(Connecting, u64)>,
    generation: u64,
}

/// A connection being made, which every caller that finds none awaits.
type Connecting = SharedFuture<BoxFuture<'static, Result<MultiplexedConnection, Arc<PoolError>>>>;

/// A connection for one call that blocks it, see [`SharedConnection::dedicated`].
pub(super) struct Dedicated<'a> {
    pub(super) connection: MultiplexedConnection,
    store: &'a SharedConnection,
}

impl Dedicated<'_> {
    /// The call ended with an answer: the connection serves the next such call, up to as
    /// many idle as the pool holds.
    pub(super) fn done(self) {
        let mut idle = self.store.idle();
        if idle.len() < self.store.pool.status().max_size {
            idle.push(self.connection);
        }
    }
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
