//! The Lua scripts, one file each under `scripts/`, each behind the prelude of its
//! topology, the clock and fencing counter's functions, and the value format's.

use std::sync::LazyLock;

use redis::{Script, ScriptInvocation};

/// Redis's clock, and the fencing counter that never counts below it.
const CLOCK: &str = include_str!("scripts/clock.lua");

/// The scripts that read or write lock values, each its prelude (`single.lua` or
/// `cluster.lua`: where the keys come from, and what a node may do with them), the clock's
/// and the fencing counter's functions (`clock.lua`), the value format's (`value.lua`),
/// then its own body.
pub(crate) struct Scripts {
    /// Locks a batch, all or nothing, or reserves it for a waiter in line.
    pub(super) acquire: Script,
    /// Extends a batch if every key still has the hold.
    pub(super) extend: Script,
    /// Ends a hold on the keys that still have it, and announces the release.
    pub(super) release: Script,
    /// Takes a waiter's reservations off its keys, and announces it.
    pub(super) withdraw: Script,
    /// Reads what an operator may see of keys: state, ttl, holds, waiters; never owners.
    pub(super) inspect: Script,
    /// Ends every hold on keys, whoever has it, and announces it.
    pub(super) force_release: Script,
    /// Puts a waiter's reservation on keys (the keys of a refused batch that a cluster
    /// group or an earlier step took).
    pub(super) reserve: Script,
    /// Whether the keys go as arguments (a group of a batch on a cluster node) rather than
    /// as declared keys.
    pub(super) keys_as_args: bool,
}

impl Scripts {
    fn with_prelude(prelude: &str, keys_as_args: bool) -> Self {
        let script = |body: &str| {
            Script::new(&[prelude, CLOCK, include_str!("scripts/value.lua"), body].concat())
        };
        Self {
            acquire: script(include_str!("scripts/acquire.lua")),
            extend: script(include_str!("scripts/extend.lua")),
            release: script(include_str!("scripts/release.lua")),
            withdraw: script(include_str!("scripts/withdraw.lua")),
            inspect: script(include_str!("scripts/inspect.lua")),
            force_release: script(include_str!("scripts/force_release.lua")),
            reserve: script(include_str!("scripts/reserve.lua")),
            keys_as_args,
        }
    }

    /// An invocation of `script` (one of these) on `keys`.
    pub(super) fn prepare<'a>(&self, script: &'a Script, keys: &[String]) -> ScriptInvocation<'a> {
        let mut invocation = script.prepare_invoke();
        if self.keys_as_args {
            invocation.arg(keys.len()).arg(keys);
        } else {
            invocation.key(keys);
        }
        invocation
    }
}

/// The scripts on one Redis, and on each Redlock master.
pub(super) static SINGLE: LazyLock<Scripts> =
    LazyLock::new(|| Scripts::with_prelude(include_str!("scripts/single.lua"), false));

/// The scripts on a Redis Cluster node, for the keys of a batch that the node serves.
#[cfg(feature = "cluster")]
pub(super) static CLUSTER: LazyLock<Scripts> =
    LazyLock::new(|| Scripts::with_prelude(include_str!("scripts/cluster.lua"), true));

/// Counts a grant in a namespace's fencing counter, apart from any batch: the cluster
/// store's token. Its source, for `EVAL` where a node does not have it cached.
#[cfg(feature = "cluster")]
pub(crate) static COUNT_GRANT_SOURCE: LazyLock<String> =
    LazyLock::new(|| [CLOCK, include_str!("scripts/count_grant.lua")].concat());

/// [`COUNT_GRANT_SOURCE`], for its hash (`EVALSHA`).
#[cfg(feature = "cluster")]
pub(crate) static COUNT_GRANT: LazyLock<Script> =
    LazyLock::new(|| Script::new(&COUNT_GRANT_SOURCE));

/// Raises a namespace's fencing counter to a floor (for Redlock).
pub(super) static RAISE_FENCE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/raise_fence.lua")));
