//! The memory store with a hook around its acquisitions, releases, withdrawals and
//! extensions, for unit tests of what the layer does when a store answers late, never, or
//! after the world changed.

use std::time::Duration;

use super::MemoryStore;
use crate::store::{
    contract::{
        Acquire, AcquireRequest, Holder, KeyView, Keys, Line, LockStore, Mode, Modes, Reply, Ticket,
    },
    wake::Wakeups,
};

/// `holder`'s exclusive acquisition of `keys` for `ttl`, in no line: how these tests take
/// keys for the holders they put in a waiter's or a guard's way.
pub(crate) fn exclusive(keys: Keys, holder: Holder, ttl: Duration) -> AcquireRequest {
    AcquireRequest {
        namespace: "lock:".into(),
        keys,
        modes: Modes::All(Mode::Exclusive),
        holder,
        ttl,
        report: 0,
        line: Line::Outside,
        reserve: Duration::ZERO,
        retry: false,
    }
}

/// What a test changes of the memory store's answers; by default, nothing.
pub(crate) trait Hooks: std::fmt::Debug + Send + Sync + 'static {
    fn acquire<'a>(
        &'a self,
        store: &'a MemoryStore,
        request: &'a AcquireRequest,
    ) -> Reply<'a, Acquire> {
        store.acquire(request)
    }

    fn release<'a>(
        &'a self,
        store: &'a MemoryStore,
        keys: &'a Keys,
        holder: Holder,
    ) -> Reply<'a, usize> {
        store.release(keys, holder)
    }

    fn withdraw<'a>(
        &'a self,
        store: &'a MemoryStore,
        keys: &'a Keys,
        ticket: Ticket,
    ) -> Reply<'a, usize> {
        store.withdraw(keys, ticket)
    }

    fn extend<'a>(
        &'a self,
        store: &'a MemoryStore,
        keys: &'a Keys,
        holder: Holder,
        ttl: Duration,
    ) -> Reply<'a, bool> {
        store.extend(keys, holder, ttl)
    }
}

/// The memory store, its acquisitions, releases, withdrawals and extensions going through
/// `hooks`.
#[derive(Debug)]
pub(crate) struct Intercepted<H> {
    pub(crate) store: MemoryStore,
    pub(crate) hooks: H,
}

impl<H> Intercepted<H> {
    pub(crate) fn new(hooks: H) -> Self {
        Self {
            store: MemoryStore::new(),
            hooks,
        }
    }
}

impl<H: Hooks> LockStore for Intercepted<H> {
    fn announces_releases(&self) -> bool {
        self.store.announces_releases()
    }

    fn acquire<'a>(&'a self, request: &'a AcquireRequest) -> Reply<'a, Acquire> {
        self.hooks.acquire(&self.store, request)
    }

    fn release<'a>(&'a self, keys: &'a Keys, holder: Holder) -> Reply<'a, usize> {
        self.hooks.release(&self.store, keys, holder)
    }

    fn withdraw<'a>(&'a self, keys: &'a Keys, ticket: Ticket) -> Reply<'a, usize> {
        self.hooks.withdraw(&self.store, keys, ticket)
    }

    fn extend<'a>(&'a self, keys: &'a Keys, holder: Holder, ttl: Duration) -> Reply<'a, bool> {
        self.hooks.extend(&self.store, keys, holder, ttl)
    }

    fn wakeups(&self) -> &Wakeups {
        self.store.wakeups()
    }

    fn check(&self) -> Reply<'_, ()> {
        self.store.check()
    }

    fn inspect<'a>(&'a self, keys: &'a Keys) -> Reply<'a, Vec<KeyView>> {
        self.store.inspect(keys)
    }

    fn force_release<'a>(&'a self, keys: &'a Keys) -> Reply<'a, usize> {
        self.store.force_release(keys)
    }
}
