//! The signal that starts a graceful shutdown: SIGTERM (what orchestrators
//! send) or Ctrl-C.

use std::future::Future;

/// Listens for SIGTERM and Ctrl-C from this call on, and resolves when one
/// arrives. Call it before starting to serve: a signal that came before the
/// handlers were installed would take its default action, an exit that
/// writes nothing.
pub fn signal() -> impl Future<Output = ()> {
    #[cfg(unix)]
    let (mut terminate, mut interrupt) = {
        use tokio::signal::unix::{SignalKind, signal};
        (
            signal(SignalKind::terminate()).ok(),
            signal(SignalKind::interrupt()).ok(),
        )
    };
    async move {
        #[cfg(unix)]
        tokio::select! {
            () = received(interrupt.as_mut()) => tracing::info!("Ctrl-C received"),
            () = received(terminate.as_mut()) => tracing::info!("SIGTERM received"),
        }
        #[cfg(not(unix))]
        {
            if tokio::signal::ctrl_c().await.is_ok() {
                tracing::info!("Ctrl-C received");
            } else {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Resolves when `signal` delivers; never if it could not be installed.
#[cfg(unix)]
async fn received(signal: Option<&mut tokio::signal::unix::Signal>) {
    match signal {
        Some(signal) => {
            signal.recv().await;
        }
        None => std::future::pending().await,
    }
}
