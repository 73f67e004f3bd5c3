//! A TCP proxy on a free loopback port, between the service and a `redis-server`, that
//! puts faults on the wire: latency, a stall, replies lost after the command went through
//! (the script ran, the client never hears), connections reset, and the bytes of the
//! connections open at one moment held back while later ones pass (a delayed packet).
//! Stopped when dropped.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{
        tcp::{OwnedReadHalf, OwnedWriteHalf},
        TcpListener, TcpStream,
    },
    sync::watch,
    task::JoinHandle,
};

/// What the proxy does to the bytes it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) enum Fault {
    /// Carries them as they come.
    None,
    /// Holds each chunk, either way, this long before it carries it on.
    Latency(Duration),
    /// Carries nothing, either way, until the fault changes; connections stay open.
    Stall,
    /// Carries the commands to the server and throws its replies away.
    DropReplies,
}

pub(crate) struct Proxy {
    port: u16,
    fault: watch::Sender<Fault>,
    /// Counts resets: every connection open when it moves is reset.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    resets: watch::Sender<u64>,
    /// The connections numbered below it hold their bytes (0: none does).
    held_below: watch::Sender<u64>,
    /// How many connections were accepted: the next one's number.
    accepted: Arc<AtomicU64>,
    listener: JoinHandle<()>,
}

impl Proxy {
    /// A proxy to the server on loopback port `upstream`, carrying bytes without fault.
    pub(crate) async fn start(upstream: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (fault, _) = watch::channel(Fault::None);
        let (resets, _) = watch::channel(0);
        let (held_below, _) = watch::channel(0);
        let accepted = Arc::new(AtomicU64::new(0));
        let (faults, reset_count) = (fault.subscribe(), resets.subscribe());
        let (holds, counter) = (held_below.subscribe(), accepted.clone());
        let listener = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    continue;
                };
                let wires = Wires {
                    faults: faults.clone(),
                    hold: (counter.fetch_add(1, Ordering::SeqCst), holds.clone()),
                };
                tokio::spawn(carry(client, server, wires, reset_count.clone()));
            }
        });
        Self {
            port,
            fault,
            resets,
            held_below,
            accepted,
            listener,
        }
    }

    /// Holds back the bytes, either way, of every connection open now (as a network holds
    /// a delayed packet), until [`release_held`](Self::release_held); later connections
    /// pass.
    pub(crate) fn hold_open(&self) {
        self.held_below
            .send_replace(self.accepted.load(Ordering::SeqCst));
    }

    /// Lets the held bytes go on.
    pub(crate) fn release_held(&self) {
        self.held_below.send_replace(0);
    }

    /// The loopback port it listens on.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub(crate) fn set(&self, fault: Fault) {
        self.fault.send_replace(fault);
    }

    /// Resets (RST) every connection open now; later ones are carried as before.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn reset(&self) {
        self.resets.send_modify(|count| *count += 1);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

/// What a connection's bytes obey: the fault of the moment, and the hold on the
/// connections open when it began (its number, and the number held below).
#[derive(Clone)]
struct Wires {
    faults: watch::Receiver<Fault>,
    hold: (u64, watch::Receiver<u64>),
}

/// Carries one connection both ways until either side closes it or a reset comes.
async fn carry(
    client: TcpStream,
    server: TcpStream,
    wires: Wires,
    mut resets: watch::Receiver<u64>,
) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    // Closed with SO_LINGER 0, the client's socket sends RST rather than FIN.
    let _ = client.set_zero_linger();
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    resets.mark_unchanged();
    tokio::select! {
        _ = pump(client_read, server_write, wires.clone(), false) => {}
        _ = pump(server_read, client_write, wires, true) => {}
        _ = resets.changed() => {}
    }
}

/// Carries bytes from `from` to `to`, as the fault of the moment says. `replies`: this is
/// the server's side, whose bytes [`Fault::DropReplies`] throws away.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, wires: Wires, replies: bool) {
    let Wires {
        mut faults,
        hold: (number, mut held_below),
    } = wires;
    let mut buffer = vec![0; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        if held_below.wait_for(|below| number >= *below).await.is_err() {
            return;
        }
        let fault = *faults.borrow_and_update();
        match fault {
            Fault::None => {}
            Fault::Latency(delay) => tokio::time::sleep(delay).await,
            Fault::Stall => {
                if faults.wait_for(|f| *f != Fault::Stall).await.is_err() {
                    return;
                }
            }
            Fault::DropReplies if replies => continue,
            Fault::DropReplies => {}
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}
