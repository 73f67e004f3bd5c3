//! Replica acknowledgement: a grant counts only once enough replicas have it (`WAIT`).

use std::time::Duration;

use redis::{aio::ConnectionLike, FromRedisValue};

use super::scripts::Invocation;
use crate::{duration::capped, store::error::StoreError};

/// How many replicas must acknowledge a grant, and how long to wait for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReplicaAck {
    pub(crate) replicas: usize,
    pub(crate) timeout: Duration,
}

impl ReplicaAck {
    /// # Panics
    ///
    /// If `replicas` or `timeout` is zero: that would wait for nothing.
    pub(crate) fn new(replicas: usize, timeout: Duration) -> Self {
        assert!(
            replicas > 0,
            "a replica acknowledgement needs at least 1 replica"
        );
        assert!(
            !timeout.is_zero(),
            "a replica acknowledgement needs a timeout"
        );
        Self {
            replicas,
            timeout: capped(timeout),
        }
    }

    /// The timeout as `WAIT` takes it: milliseconds, at least 1 (0 would wait for ever).
    fn wait_ms(self) -> u64 {
        u64::try_from(self.timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }
}

/// What an acquisition that waits for replicas came to.
pub(super) enum Acknowledged<T> {
    /// The script's answer: refused, or granted and acknowledged by enough replicas.
    Answer(T),
    /// Granted, but only this many replicas acknowledged it in time.
    Short(usize),
}

/// Runs the acquire `script` on `connection` (a connection of its own: `WAIT` blocks every
/// command behind it on its connection, and so would hold up every other call of the
/// process on the shared one), then, when `granted` says that its answer is a grant,
/// `WAIT`s on the same connection for `ack`: `WAIT` counts the replicas that have every
/// write this connection made, so it must be the connection that ran the script.
pub(super) async fn acquire_acknowledged<T, C>(
    connection: &mut C,
    script: &Invocation,
    granted: impl Fn(&T) -> bool,
    ack: ReplicaAck,
) -> Result<Acknowledged<T>, StoreError>
where
    T: FromRedisValue,
    C: ConnectionLike + Send,
{
    let answer: T = script
        .invoke(connection)
        .await
        .map_err(StoreError::unknown)?;
    if !granted(&answer) {
        return Ok(Acknowledged::Answer(answer));
    }
    let acknowledged: usize = redis::cmd("WAIT")
        .arg(ack.replicas)
        .arg(ack.wait_ms())
        .query_async(connection)
        .await
        .map_err(|error| {
            StoreError::unknown(error).context("waiting for replicas to acknowledge a grant")
        })?;
    Ok(if acknowledged >= ack.replicas {
        Acknowledged::Answer(answer)
    } else {
        Acknowledged::Short(acknowledged)
    })
}

/// What is wrong with the replicas of the master behind `connection` for `ack`, if
/// anything: fewer connected than a grant waits for (`INFO replication`), so that every
/// grant would wait for nothing and be refused. For the store's check.
pub(super) async fn missing_replicas<C: ConnectionLike + Send>(
    connection: &mut C,
    ack: ReplicaAck,
) -> redis::RedisResult<Option<String>> {
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(connection)
        .await?;
    let connected = info
        .lines()
        .find_map(|line| line.strip_prefix("connected_slaves:"))
        .and_then(|count| count.trim().parse::<usize>().ok())
        .unwrap_or(0);
    Ok((connected < ack.replicas).then(|| {
        format!(
            "every grant waits for {} replicas, and this master has {connected} connected",
            ack.replicas
        )
    }))
}
