//! `serve --tls-cert FILE --tls-key FILE`: the rustls server configuration the accept loop
//! hands each connection to (`startup`), so that TLS connections keep the same cap, header
//! timeout and drain as plain ones. Kubernetes calls admission webhooks over TLS only.

use std::path::Path;
use std::sync::Arc;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

/// Largest PEM file read: a chain of a few certificates, or a key, is a few KiB.
const MAX_PEM_BYTES: u64 = 1024 * 1024;

/// A TLS acceptor serving the certificate chain of `cert` with the key of `key` (PEM files:
/// a chain, leaf first; a PKCS#8, PKCS#1 or SEC1 key), HTTP/1.1 by ALPN. Read once, at start:
/// a renewed certificate is served after a restart.
pub fn acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&read(cert)?)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("--tls-cert {}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!(
            "--tls-cert {}: no PEM certificate in it",
            cert.display()
        ));
    }
    let key_der = PrivateKeyDer::from_pem_slice(&read(key)?)
        .map_err(|e| format!("--tls-key {}: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| {
            format!(
                "--tls-cert {} with --tls-key {}: {e}",
                cert.display(),
                key.display()
            )
        })?;
    // hyper serves HTTP/1 here: say so, so that an HTTP/2 client falls back.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    let size = std::fs::metadata(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    if size > MAX_PEM_BYTES {
        return Err(format!(
            "{}: {size} bytes; at most {MAX_PEM_BYTES} are read",
            path.display()
        ));
    }
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
}
