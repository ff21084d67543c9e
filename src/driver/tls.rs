//! TLS for `rediss://` nodes, with rustls (feature `tls-rustls`).
//!
//! [`Tls`] says whom to trust and who we are; [`TlsStream`] runs rustls over
//! the connection's non-blocking socket, so that a round still waits on all
//! nodes' sockets at once with `poll(2)`.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore};

use crate::error::InvalidInput;

/// TLS settings for `rediss://` nodes, given to
/// [`Builder::tls`](crate::Builder::tls).
///
/// Server certificates are always verified: against the system's root
/// certificates by default (Mozilla's, compiled in, with the feature
/// `tls-rustls-webpki-roots`), or against the CAs of
/// [`ca_file`](Self::ca_file). The name checked is the URL's host (a DNS
/// name or an IP address, which the certificate must list).
///
/// ```no_run
/// # #[cfg(feature = "tls-rustls")] {
/// use quorumlock::Tls;
///
/// let locks = quorumlock::Redlock::builder()
///     .nodes([
///         "rediss://locker:secret@redis-1.internal:6380",
///         "rediss://locker:secret@redis-2.internal:6380",
///         "rediss://locker:secret@redis-3.internal:6380",
///     ])
///     .tls(
///         Tls::new()
///             .ca_file("/etc/redis/tls/ca.crt")
///             // Only for nodes that require client certificates (mutual TLS):
///             .client_auth("/etc/redis/tls/client.crt", "/etc/redis/tls/client.key"),
///     )
///     .build()?;
/// # }
/// # Ok::<(), quorumlock::Error>(())
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
#[cfg_attr(docsrs, doc(cfg(feature = "tls-rustls")))]
pub struct Tls {
    ca_files: Vec<PathBuf>,
    client: Option<(PathBuf, PathBuf)>,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("ca_files", &self.ca_files)
            .field("client_cert", &self.client.as_ref().map(|(c, _)| c))
            .finish()
    }
}

impl Tls {
    /// Verifies servers against the default roots, with no client
    /// certificate. `rediss://` nodes use this when [`Builder::tls`] is not
    /// called.
    ///
    /// [`Builder::tls`]: crate::Builder::tls
    pub fn new() -> Self {
        Tls::default()
    }

    /// Trusts the CA certificates in this PEM file instead of the default
    /// roots (call again to add more files). For private CAs and
    /// self-signed server certificates.
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_files.push(path.into());
        self
    }

    /// Presents this certificate chain (PEM, leaf first) and private key
    /// (PEM: PKCS#8, PKCS#1 or SEC1) to nodes that ask for one.
    pub fn client_auth(mut self, cert_chain: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.client = Some((cert_chain.into(), key.into()));
        self
    }

    /// Loads the files and builds the rustls configuration.
    pub(crate) fn config(&self) -> Result<Arc<ClientConfig>, InvalidInput> {
        let roots = self.roots()?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(format!("no TLS protocol version available: {e}")))?
            .with_root_certificates(roots);
        let config = match &self.client {
            None => builder.with_no_client_auth(),
            Some((chain, key)) => {
                let certs = read_certs(chain, "client certificate")?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| bad(format!("client key {}: {}", key.display(), pem_error(&e))))?;
                builder
                    .with_client_auth_cert(certs, key)
                    .map_err(|e| bad(format!("client certificate and key: {e}")))?
            }
        };
        Ok(Arc::new(config))
    }

    fn roots(&self) -> Result<RootCertStore, InvalidInput> {
        let mut roots = RootCertStore::empty();
        if !self.ca_files.is_empty() {
            for path in &self.ca_files {
                for cert in read_certs(path, "CA file")? {
                    roots
                        .add(cert)
                        .map_err(|e| bad(format!("CA file {}: {e}", path.display())))?;
                }
            }
            return Ok(roots);
        }
        default_roots(&mut roots)?;
        Ok(roots)
    }
}

#[cfg(feature = "tls-rustls-webpki-roots")]
fn default_roots(roots: &mut RootCertStore) -> Result<(), InvalidInput> {
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    Ok(())
}

#[cfg(not(feature = "tls-rustls-webpki-roots"))]
fn default_roots(roots: &mut RootCertStore) -> Result<(), InvalidInput> {
    let found = rustls_native_certs::load_native_certs();
    let (added, _ignored) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found
            .errors
            .first()
            .map_or_else(|| "none installed".to_owned(), ToString::to_string);
        return Err(bad(format!(
            "no system root certificates ({why}); give the nodes' CA with Tls::ca_file"
        )));
    }
    Ok(())
}

fn read_certs(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, InvalidInput> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| bad(format!("{what} {}: {}", path.display(), pem_error(&e))))?;
    if certs.is_empty() {
        return Err(bad(format!(
            "{what} {}: no PEM certificate in it",
            path.display()
        )));
    }
    Ok(certs)
}

fn pem_error(e: &rustls::pki_types::pem::Error) -> String {
    match e {
        rustls::pki_types::pem::Error::Io(e) => e.to_string(),
        rustls::pki_types::pem::Error::NoItemsFound => "no PEM item of that kind in it".to_owned(),
        e => format!("{e:?}"),
    }
}

fn bad(reason: String) -> InvalidInput {
    InvalidInput::Tls(reason)
}

/// What a `rediss://` node needs to connect: the shared configuration and
/// the name its certificate must carry.
#[derive(Clone)]
pub(crate) struct TlsTarget {
    pub config: Arc<ClientConfig>,
    pub name: ServerName<'static>,
}

impl TlsTarget {
    pub(crate) fn new(config: Arc<ClientConfig>, host: &str) -> Result<TlsTarget, String> {
        // A bracketed IPv6 literal arrives without its brackets from the URL.
        let name = ServerName::try_from(host.to_owned())
            .map_err(|e| format!("{host:?} is not a name TLS can verify: {e}"))?;
        Ok(TlsTarget { config, name })
    }
}

/// A TLS failure: a certificate refused, an alert from the node.
#[derive(Debug)]
pub(crate) struct TlsError(pub String);

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TLS: {}", self.0)
    }
}

impl std::error::Error for TlsError {}

/// rustls over a non-blocking socket. Reads and writes never block: they
/// return `WouldBlock` where the socket would.
pub(crate) struct TlsStream {
    pub tcp: TcpStream,
    tls: ClientConnection,
}

impl fmt::Debug for TlsStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsStream")
            .field("handshaking", &self.tls.is_handshaking())
            .finish()
    }
}

impl TlsStream {
    pub(crate) fn new(tcp: TcpStream, target: &TlsTarget) -> io::Result<TlsStream> {
        let tls = ClientConnection::new(target.config.clone(), target.name.clone())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, TlsError(e.to_string())))?;
        Ok(TlsStream { tcp, tls })
    }

    pub(crate) fn is_handshaking(&self) -> bool {
        self.tls.is_handshaking()
    }

    /// Whether encrypted bytes wait to be written to the socket.
    pub(crate) fn wants_write(&self) -> bool {
        self.tls.wants_write()
    }

    /// Writes buffered records to the socket until it would block.
    pub(crate) fn push(&mut self) -> io::Result<()> {
        while self.tls.wants_write() {
            match self.tls.write_tls(&mut self.tcp) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads records from the socket once and processes them. `Ok(false)`
    /// at end of stream.
    pub(crate) fn pull(&mut self) -> io::Result<bool> {
        let n = loop {
            match self.tls.read_tls(&mut self.tcp) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                r => break r?,
            }
        };
        if let Err(e) = self.tls.process_new_packets() {
            // Tell the node why (an alert), if the socket takes it.
            let _ = self.push();
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                TlsError(e.to_string()),
            ));
        }
        self.push()?;
        Ok(n > 0)
    }

    /// Encrypts `buf` (all of it, or nothing while rustls's buffer is full)
    /// and writes what the socket takes.
    pub(crate) fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.push()?;
        let n = self.tls.writer().write(buf)?;
        self.push()?;
        if n == 0 && !buf.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    }

    /// Decrypted bytes: what rustls holds, else what the socket has.
    /// `Ok(0)` once the node closed the connection.
    pub(crate) fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.tls.reader().read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            if !self.pull()? {
                // End of stream without close_notify: the reader says so next.
                return match self.tls.reader().read(buf) {
                    Ok(n) => Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
                    Err(e) => Err(e),
                };
            }
        }
    }
}

/// Whether `e` is a TLS failure (a certificate refused, an alert), with
/// its message.
pub(crate) fn tls_failure(e: &io::Error) -> Option<String> {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<TlsError>())
        .map(|t| t.0.clone())
}
