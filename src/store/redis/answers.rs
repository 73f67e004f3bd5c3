//! The idempotency layer's answers on one Redis (and a cluster node's, through
//! [`store_answer_command`]): a key a request, written once, kept for its retention.

use bytes::Bytes;

use super::{connection::Command, millis, RedisStore};
use crate::store::contract::{AnswerStore, Reply, StoredAnswer};

impl AnswerStore for RedisStore {
    fn load_answer<'a>(&'a self, key: &'a str) -> Reply<'a, Option<Bytes>> {
        Box::pin(async move {
            let answer: Option<Vec<u8>> = self
                .connection
                .send(Command::Plain(redis::cmd("GET").arg(key)))
                .await?;
            Ok(answer.map(Bytes::from))
        })
    }

    fn store_answer<'a>(&'a self, answer: &'a StoredAnswer) -> Reply<'a, bool> {
        Box::pin(async move {
            let set = store_answer_command(answer);
            let stored: Option<String> = self.connection.send(Command::Plain(&set)).await?;
            Ok(stored.is_some())
        })
    }
}

/// `SET key answer PX retention NX`: keeps an idempotent answer unless one is there.
pub(crate) fn store_answer_command(answer: &StoredAnswer) -> redis::Cmd {
    let mut set = redis::cmd("SET");
    set.arg(&*answer.key)
        .arg(&answer.bytes[..])
        .arg("PX")
        .arg(millis(answer.retention))
        .arg("NX");
    set
}
