//! Wake-ups across processes over Redis pub/sub: a release publishes its message
//! (`store/message.rs`) on a channel; every process subscribed to it wakes the waiters the
//! message names.

use std::{sync::Weak, time::Duration};

use futures_util::StreamExt;

use crate::store::{
    message::{wake_from_message, Reconnecting},
    wake::Wakeups,
};

/// The pub/sub channel on which releases name the wake-up slots of their keys.
pub(in crate::store) const RELEASED_CHANNEL: &str = "tower-batch-lock:released";

/// Wakes this process's waiters for every release announced on [`RELEASED_CHANNEL`], until
/// the store is dropped. Reconnects after a lost connection, and then wakes every waiter:
/// releases in the gap went unheard.
pub(super) async fn listen_for_releases(client: redis::Client, wakeups: Weak<Wakeups>) {
    let mut reconnecting = Reconnecting::new(client.get_connection_info().addr().to_string());
    while wakeups.strong_count() > 0 {
        match subscribe(&client).await {
            Ok(pubsub) => {
                reconnecting.listening();
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
                reconnecting.failed(&"lost the subscription");
            }
            Err(error) => reconnecting.failed(&error),
        }
        reconnecting.pause().await;
    }
}

async fn subscribe(client: &redis::Client) -> redis::RedisResult<redis::aio::PubSub> {
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(RELEASED_CHANNEL).await?;
    Ok(pubsub)
}
