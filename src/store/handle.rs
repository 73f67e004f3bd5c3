//! [`Store`]: a lock store of any kind, ready for [`Locks::new`](crate::Locks::new).

use std::{fmt, sync::Arc};

#[cfg(feature = "idempotency")]
use super::contract::AnswerStore;
use super::{contract::LockStore, memory::MemoryStore};

/// A lock store, ready for [`Locks::new`](crate::Locks::new). Cheap to clone: clones
/// share the store.
#[derive(Clone)]
pub struct Store {
    pub(crate) locks: Arc<dyn LockStore>,
    #[cfg(feature = "idempotency")]
    pub(crate) answers: Arc<dyn AnswerStore>,
}

impl Store {
    /// A new, empty in-memory store, shared only by the [`Locks`](crate::Locks) made from it
    /// (and their clones): for tests that must not see each other's locks. Layers on it do
    /// not exclude layers on [`Locks::memory`](crate::Locks::memory) or
    /// [`LockLayer::new`](crate::LockLayer::new), even on the same key.
    pub fn isolated_memory() -> Self {
        Self::of(Arc::new(MemoryStore::new()))
    }

    #[cfg(feature = "idempotency")]
    pub(crate) fn of<S: LockStore + AnswerStore>(store: Arc<S>) -> Self {
        Self {
            locks: store.clone(),
            answers: store,
        }
    }

    #[cfg(not(feature = "idempotency"))]
    pub(crate) fn of<S: LockStore>(store: Arc<S>) -> Self {
        Self { locks: store }
    }
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.locks.fmt(f)
    }
}
