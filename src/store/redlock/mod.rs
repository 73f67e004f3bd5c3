//! Locks over several independent Redis masters: the Redlock algorithm, for whole batches
//! ([`Redlock`] tells the user's side). Every master is a [`RedisStore`] of its own, and
//! every call goes to all of them at once through the fanout (`store.rs`); `majority.rs`
//! is how a majority decides.

use std::{collections::HashSet, sync::Arc, time::Duration};

use redis::IntoConnectionInfo;

use super::{
    fanout::{node_pool, NodeUrls},
    handle::Store,
    redis::RedisStore,
    wake::Wakeups,
};
use store::{Master, RedlockStore};

mod majority;
mod store;

/// How long one master may take to answer one call, unless [`Redlock::node_timeout`] says
/// otherwise.
const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_millis(100);

/// Locks over several independent Redis masters, with the Redlock algorithm: a batch is
/// locked when a majority of the masters locked all of it, so the locks survive the loss
/// of any minority of the masters.
///
/// ```
/// use std::time::Duration;
/// use tower_batch_lock::{store::Redlock, Locks};
///
/// # fn main() -> Result<(), tower_batch_lock::redis::RedisError> {
/// // Nothing connects yet: each master gets a pool that connects on first use.
/// let store = Redlock::new([
///     "redis://10.0.0.1:6379/",
///     "redis://10.0.0.2:6379/",
///     "redis://10.0.0.3:6379/",
/// ])
/// .node_timeout(Duration::from_millis(50))
/// .build()?;
/// let locks = Locks::new(store).ttl(Duration::from_secs(10));
///
/// // Fewer than three masters, or one listed twice, is refused.
/// assert!(Redlock::new(["redis://10.0.0.1/", "redis://10.0.0.2/"]).build().is_err());
/// # drop(locks);
/// # Ok(())
/// # }
/// ```
///
/// # The algorithm, for batches
///
/// Each master holds the same data as a single Redis does with [`Redis`](super::Redis): one key per
/// resource holding the owner token, with a `PX` TTL, and a fencing counter per namespace,
/// written by the same scripts. An acquisition sends the whole batch to every master at
/// once, each call bounded by the node timeout, and measures the time it takes on a
/// monotonic clock. It is granted when a majority (`N / 2 + 1`) of the masters granted the
/// *whole* batch and `validity = ttl - elapsed - drift` is still positive, with
/// `drift = ttl / 100 + 2 ms` for the masters' clocks running at different rates. The
/// [`Lease`](crate::Lease) expires at `start + ttl - drift`, earlier than any master lets the
/// keys go. Otherwise the batch is released on every master that might hold any of it,
/// and the request is refused: 409 when a majority answered, some of them with a
/// conflicting key (with [`Locks::wait`](crate::Locks::wait) it waits in line, as on one
/// Redis), 503 when a majority could not answer or the majority came too late. A failed
/// attempt never leaves a key behind on a master that answers.
///
/// Renewal ([`Locks::renew_lease`](crate::Locks::renew_lease)) extends the keys on every master and keeps the lease only
/// if a majority still held all of them; release goes to every master at once.
///
/// # Failures
///
/// - A master that is down (connection refused) costs nothing; one that is frozen, slow or
///   cut off costs at most the node timeout, and only when its answer is needed: neither an
///   acquisition that a majority granted nor a release waits for the masters beyond that
///   majority (a release gives them as long again as the majority took), and their calls
///   finish in the background. A refused acquisition waits for every master (each at most
///   the node timeout) before its roll-back, which then never overtakes it, and before its
///   answer, so that a waiter's place in line is where its answer says.
/// - With a majority down, requests get 503 at once (refused connections) or after the
///   node timeout (frozen masters), never after the TTL.
/// - Keys left on a master that did not answer in time are released in the background as
///   soon as it answers, and expire with their TTL if it never does.
/// - Waiting requests wake at once for a release in any process: each master's release
///   names the waiters first in line there, and reaches the other processes through their
///   subscription to that master (a waiter woken by several masters wakes once).
///
/// # What it guarantees, and what it does not
///
/// Mutual exclusion holds under the assumptions of Redlock: the masters do not lose their
/// keys, their clocks advance at about the right rate (within the drift allowance over a
/// TTL), and a holder finishes its work before its lease expires.
///
/// - **Restarts.** A master restarted without its data (no persistence, or `appendfsync`
///   not `always`) forgets the locks it held. While a majority of the masters that granted
///   a batch still hold it, it stays locked; once restarts have cost it its majority,
///   another request can be granted the same keys while the first still runs, and the
///   first learns of it only at its next renewal ([`Lease::lost`](crate::Lease::lost)).
///   Either keep a crashed master out for at least one TTL before it rejoins (antirez's
///   *delayed restarts*), or run the masters with `appendonly yes` and
///   `appendfsync always`.
/// - **Pauses and clocks.** As Martin Kleppmann argues in *How to do distributed locking*
///   (2016), a lease cannot stop a holder that stalls past its expiry (a GC pause, a slow
///   disk, a lost network) from writing after another holder got the keys, and Redlock's
///   expiry rests on clocks: a master whose clock jumps forward lets keys go early.
///   Salvatore Sanfilippo's reply, *Is Redlock safe?* (2016), holds that the algorithm
///   only assumes clocks that advance at about the same rate (no jumps: slew, do not step,
///   with NTP), and that the validity check after acquiring covers delays before the grant.
///   Both agree that a pause *after* the grant hits every lock that expires, and that only
///   the resource can then refuse the stale writer: Kleppmann with fencing tokens (which,
///   he notes, Redlock has no way to produce), antirez also by checking the holder's
///   unique value. This crate does produce tokens, under the conditions below.
/// - **Fencing tokens.** Each master counts grants per namespace, as a single Redis does,
///   floored by its own clock. The token of a grant is the largest count among the
///   masters that granted it. A maximum over different majorities does not grow by itself:
///   a master that refused (or missed) some grants, or whose clock is behind, falls behind,
///   and a later majority of lagging masters would count from a smaller number. So when
///   fewer than a majority of the granting masters reached the largest count, the grant
///   first raises the lagging ones to it (one more round trip, only then), and is granted
///   only once a majority holds at least that count. Any later grant of a shared key needs
///   a majority as well, which shares a master with that one; there it could not be
///   granted before the key was released or expired, so it counts on from a larger number.
///   Tokens therefore strictly increase across grants that share a key. A master that
///   loses its counter (a restart without persistence, a failover to a replica that missed
///   counts) starts again from its clock, above the tokens handed out before; even when
///   every master lost it, the next tokens are larger as long as the masters' clocks agree
///   to better than the time the loss took, and fewer than 1,024 grants a millisecond were
///   counted ([`FencingToken`](crate::FencingToken) says exactly). Since the masters'
///   clocks tick apart, their counts now differ more often than they did (by the
///   milliseconds between their clocks), and the extra round trip that raises the lagging
///   ones is taken more often: on most grants whose majority did not all read the same
///   millisecond.
///
/// Use Redlock when one Redis is a single point of failure you cannot accept and you can
/// run three (or five) independent masters; not to make a lock stronger than the
/// resource it protects. For correctness that must survive pauses and clock trouble, let
/// the resource check fencing tokens or use a consensus store.
#[derive(Clone, Debug)]
pub struct Redlock {
    masters: NodeUrls,
}

impl Redlock {
    /// Redlock over the independent Redis masters at `urls` (`redis://host:port/db`;
    /// credentials go in the URL). [`build`](Self::build) checks them.
    pub fn new<I>(urls: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        Self {
            masters: NodeUrls::new(urls, DEFAULT_NODE_TIMEOUT),
        }
    }

    /// How long one master may take to answer one call (getting a connection included)
    /// before it counts as failed for that call. Default 100 ms: many times a round trip
    /// and a script over a thousand keys in one data center, and a small part of any
    /// sensible TTL. A batch bigger than a [step](Self::step_keys) goes in several scripts,
    /// and gets this much for each: a master busy with others' big batches is slow, not
    /// down. Keep it far below the TTL: an acquisition whose majority answers later than
    /// `ttl - drift` fails anyway.
    ///
    /// # Panics
    ///
    /// If `timeout` is zero.
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.masters.set_node_timeout(timeout);
        self
    }

    /// How many keys one script takes at most on each master (1,000 by default): a bigger
    /// batch goes to each master in steps, as on one Redis ([`Redis::step_keys`](super::Redis::step_keys)
    /// says what others see meanwhile). Each step is a round trip within the validity.
    ///
    /// # Panics
    ///
    /// If `keys` is zero.
    pub fn step_keys(mut self, keys: usize) -> Self {
        self.masters.set_step(keys);
        self
    }

    /// The store, for [`Locks::new`](crate::Locks::new). Logs a warning for an even number
    /// of masters: four tolerate one failure, as three do.
    ///
    /// # Errors
    ///
    /// When there are fewer than three masters (for one, use [`Redis`](super::Redis); two
    /// tolerate no failure at all), when a URL is not a valid Redis URL, or when two URLs
    /// name the same server. Nothing connects yet.
    pub fn build(self) -> Result<Store, redis::RedisError> {
        let NodeUrls {
            urls,
            node_timeout,
            step,
        } = self.masters;
        let count = urls.len();
        if count < 3 {
            return Err(config_error(format!(
                "Redlock needs at least 3 independent Redis masters, got {count}; \
                 for one, use store::Redis"
            )));
        }
        let mut servers = HashSet::new();
        let mut masters = Vec::with_capacity(count);
        // One set of waiters for all the masters: each master's release names the waiters
        // first in line there, and wakes them here, and in other processes through the
        // subscription to that master (a waiter woken by several wakes once).
        let wakeups = Arc::new(Wakeups::new());
        for url in &urls {
            let info = url.as_str().into_connection_info()?;
            let server = info.addr().to_string();
            if !servers.insert(server.clone()) {
                return Err(config_error(format!(
                    "the Redis server {server} is listed twice: Redlock's masters must be \
                     independent servers"
                )));
            }
            let subscriber = redis::Client::open(info.clone())?;
            let pool = node_pool(info, node_timeout)
                .map_err(|e| config_error(format!("could not create a Redis pool: {e}")))?;
            let node = RedisStore::master(pool, Some(subscriber), wakeups.clone());
            masters.push(Master {
                node: Arc::new(node.with_step(step)),
                address: server.into(),
            });
        }
        if count.is_multiple_of(2) {
            tracing::warn!(
                masters = count,
                "Redlock over an even number of masters tolerates no more failures than over \
                 one fewer"
            );
        }
        let store = RedlockStore::new(masters, node_timeout, wakeups);
        Ok(Store::of(Arc::new(store)))
    }
}

fn config_error(detail: String) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::InvalidClientConfig,
        "invalid Redlock configuration",
        detail,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fewer_than_three_masters_or_a_repeated_one_are_refused() {
        let two = Redlock::new(["redis://127.0.0.1:1/", "redis://127.0.0.1:2/"]).build();
        assert!(two.unwrap_err().to_string().contains("at least 3"));
        let repeated = Redlock::new([
            "redis://127.0.0.1:1/",
            "redis://127.0.0.1:2/",
            "redis://127.0.0.1:1/0",
        ])
        .build();
        assert!(repeated.unwrap_err().to_string().contains("listed twice"));
        let invalid = Redlock::new(["redis://127.0.0.1:1/", "redis://127.0.0.1:2/", "nope://"]);
        assert!(invalid.build().is_err());
    }

    #[test]
    fn debug_output_does_not_show_the_urls() {
        let redlock = Redlock::new(["redis://user:secret@a/", "redis://b/", "redis://c/"]);
        let debug = format!("{redlock:?}");
        assert!(!debug.contains("secret"), "{debug}");
        assert!(debug.contains("nodes: 3"), "{debug}");
    }
}
