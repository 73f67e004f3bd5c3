//! Wake-ups across processes: a release names the wake-up slots of its keys on a pub/sub
//! channel, and every process subscribed to it wakes its waiters on those slots.

use std::{sync::Weak, time::Duration};

use futures_util::StreamExt;

use crate::{backoff::Backoff, store::wake::Wakeups};

/// The pub/sub channel on which releases name the wake-up slots of their keys.
pub(in crate::store) const RELEASED_CHANNEL: &str = "tower-batch-lock:released";

/// A release of more slots than this wakes every waiter instead of naming them.
const MAX_NAMED_SLOTS: usize = 64;

/// The slots as the release message carries them: `3,17,512`, or `*` for all.
pub(in crate::store) fn slot_list(slots: &[usize]) -> String {
    if slots.len() > MAX_NAMED_SLOTS {
        return "*".to_owned();
    }
    slots
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Wakes this process's waiters for every release announced on [`RELEASED_CHANNEL`], until
/// the store is dropped. Reconnects after a lost connection, and then wakes every waiter:
/// releases in the gap went unheard.
pub(super) async fn listen_for_releases(client: redis::Client, wakeups: Weak<Wakeups>) {
    let mut backoff = reconnect_backoff();
    while wakeups.strong_count() > 0 {
        match subscribe(&client).await {
            Ok(pubsub) => {
                backoff = reconnect_backoff();
                if let Some(wakeups) = wakeups.upgrade() {
                    wakeups.wake_all();
                }
                let mut messages = pubsub.into_on_message();
                loop {
                    // Wake up now and then to notice that the store is gone.
                    match tokio::time::timeout(Duration::from_secs(1), messages.next()).await {
                        Ok(Some(message)) => {
                            let Some(wakeups) = wakeups.upgrade() else {
                                return;
                            };
                            wake_from_message(&wakeups, message.get_payload_bytes());
                        }
                        Ok(None) => break,
                        Err(_) if wakeups.strong_count() == 0 => return,
                        Err(_) => {}
                    }
                }
                tracing::warn!("lost the subscription to lock releases; reconnecting");
            }
            Err(error) => {
                tracing::warn!(%error, "could not subscribe to lock releases; waiters poll")
            }
        }
        tokio::time::sleep(backoff.pause()).await;
    }
}

/// The pauses between attempts to subscribe again.
pub(in crate::store) fn reconnect_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(100), Duration::from_secs(5))
}

async fn subscribe(client: &redis::Client) -> redis::RedisResult<redis::aio::PubSub> {
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(RELEASED_CHANNEL).await?;
    Ok(pubsub)
}

pub(in crate::store) fn wake_from_message(wakeups: &Wakeups, payload: &[u8]) {
    if payload == b"*" {
        return wakeups.wake_all();
    }
    let slots = std::str::from_utf8(payload).unwrap_or_default().split(',');
    wakeups.wake_slots(slots.filter_map(|s| s.parse().ok()));
}
