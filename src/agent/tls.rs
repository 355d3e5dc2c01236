//! TLS for `wss://`: the system's root certificates, and a private CA.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// A client configuration trusting the system's roots and, with
/// `--ca-cert`, the certificates in that PEM file too.
pub fn client_config(ca_cert: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    roots.add_parsable_certificates(native.certs);
    if let Some(path) = ca_cert {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .map_err(|e| format!("cannot read --ca-cert {}: {e}", path.display()))?
            .collect::<Result<_, _>>()
            .map_err(|e| format!("--ca-cert {} is not PEM certificates: {e}", path.display()))?;
        if certs.is_empty() {
            return Err(format!("--ca-cert {} holds no certificate", path.display()));
        }
        for cert in certs {
            roots
                .add(cert)
                .map_err(|e| format!("--ca-cert {}: {e}", path.display()))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}
