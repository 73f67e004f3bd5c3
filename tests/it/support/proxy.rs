//! A TCP proxy on a free loopback port, between the service and a `redis-server`, that
//! puts faults on the wire: latency, a stall, replies lost after the command went through
//! (the script ran, the client never hears), and connections reset. Stopped when dropped.

use std::time::Duration;

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
    resets: watch::Sender<u64>,
    listener: JoinHandle<()>,
}

impl Proxy {
    /// A proxy to the server on loopback port `upstream`, carrying bytes without fault.
    pub(crate) async fn start(upstream: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (fault, _) = watch::channel(Fault::None);
        let (resets, _) = watch::channel(0);
        let (faults, reset_count) = (fault.subscribe(), resets.subscribe());
        let listener = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    continue;
                };
                tokio::spawn(carry(client, server, faults.clone(), reset_count.clone()));
            }
        });
        Self {
            port,
            fault,
            resets,
            listener,
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub(crate) fn set(&self, fault: Fault) {
        self.fault.send_replace(fault);
    }

    /// Resets (RST) every connection open now; later ones are carried as before.
    pub(crate) fn reset(&self) {
        self.resets.send_modify(|count| *count += 1);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

/// Carries one connection both ways until either side closes it or a reset comes.
async fn carry(
    client: TcpStream,
    server: TcpStream,
    faults: watch::Receiver<Fault>,
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
        _ = pump(client_read, server_write, faults.clone(), false) => {}
        _ = pump(server_read, client_write, faults, true) => {}
        _ = resets.changed() => {}
    }
}

/// Carries bytes from `from` to `to`, as the fault of the moment says. `replies`: this is
/// the server's side, whose bytes [`Fault::DropReplies`] throws away.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut faults: watch::Receiver<Fault>,
    replies: bool,
) {
    let mut buffer = vec![0; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
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
