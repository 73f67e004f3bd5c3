//! Wake-ups across processes on a cluster, with sharded pub/sub.
//!
//! `PUBLISH` on a Redis Cluster goes to every node (the cluster bus broadcasts it), which
//! floods a big cluster; `SPUBLISH` (Redis 7.0) reaches only the shard that serves the
//! channel's slot, and that shard's subscribers. A release is announced once, by the
//! process that released (never by the nodes' scripts), on [`RELEASED_CHANNEL`]; every
//! process subscribes to it with `SSUBSCRIBE` through a cluster connection of its own,
//! which redis-rs moves to the channel's new shard when the slot map changes.

use std::{fmt::Write as _, sync::Weak};

use redis::{cluster_async::ClusterConnection, PushInfo, PushKind, Value};

use crate::store::{
    message::{release_message, wake_from_message},
    redis::pubsub::RELEASED_CHANNEL,
    wake::{slots_of, Wakeups},
};

/// The message of a release of `keys` by the store tagged `tag`, leaving the waiters with
/// tickets `heads` first in line.
pub(super) fn message(keys: &[String], heads: impl Iterator<Item = u128>, tag: u64) -> String {
    let mut payload = release_message(&slots_of(keys), tag);
    // As the scripts on one Redis add them (`wake_message` in value.lua).
    for head in heads {
        let _ = write!(payload, ",#{head:036}");
    }
    payload
}

/// Announces a release's `message` in the background: a lost announcement costs other
/// processes' waiters only their poll interval.
pub(super) fn announce(control: ClusterConnection, message: String) {
    tokio::spawn(async move {
        let mut control = control;
        let sent: redis::RedisResult<i64> = redis::cmd("SPUBLISH")
            .arg(RELEASED_CHANNEL)
            .arg(message)
            .query_async(&mut control)
            .await;
        if let Err(error) = sent {
            tracing::debug!(%error, "could not announce a release on the cluster");
        }
    });
}

/// Relays every announcement that reaches this process to its waiters, until the store is
/// dropped: the push sender of the subscribing connection.
pub(super) fn relay(wakeups: Weak<Wakeups>) -> impl Fn(PushInfo) -> Result<(), ()> + Send + Sync {
    move |push: PushInfo| {
        let wakeups = wakeups.upgrade().ok_or(())?;
        match push.kind {
            PushKind::SMessage => {
                if let Some(Value::BulkString(payload)) = push.data.get(1) {
                    wake_from_message(&wakeups, payload);
                }
            }
            // Releases in the gap went unheard.
            PushKind::Disconnection => wakeups.wake_all(),
            _ => {}
        }
        Ok(())
    }
}
