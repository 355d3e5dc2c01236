//! What node code's environment holds, and the rules about URLs.

use std::collections::BTreeMap;

/// Whether `key` may reach node code: no credential
/// ([`crate::artifacts::is_credential`], the engine's own list).
pub fn allowed(key: &str) -> bool {
    !crate::artifacts::is_credential(key)
}

/// This host's environment with its credentials taken out, plus where the
/// artifact store is. Not a sandbox: node code runs as the same user.
pub fn node_env(artifact_url: &str) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> =
        std::env::vars().filter(|(key, _)| allowed(key)).collect();
    env.insert(crate::artifacts::URL_ENV.into(), artifact_url.into());
    env
}

/// Engine-assigned device numbers, read as positions in the mask this agent
/// runs under (a batch scheduler's `CUDA_VISIBLE_DEVICES=2,3`: the engine,
/// counting from this agent's inventory, asks for device 0).
pub fn remap_cuda(mask: &str, requested: &str) -> String {
    let devices: Vec<&str> = mask
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .collect();
    requested
        .split(',')
        .map(str::trim)
        .filter(|part| !part.is_empty())
        .map(|part| {
            part.parse::<usize>()
                .ok()
                .and_then(|i| devices.get(i))
                .map(|d| d.to_string())
                .unwrap_or_else(|| part.to_string())
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The artifact endpoint beside the socket, so one URL configures both.
pub fn artifacts_from(url: &str) -> String {
    let base = url
        .replacen("wss://", "https://", 1)
        .replacen("ws://", "http://", 1);
    let base = match base.rsplit_once("/workers/attach") {
        Some((before, _)) => before.to_string(),
        None => base,
    };
    format!("{base}/artifacts")
}

/// Whether the token and node secrets sent to `url` stay off the wire:
/// TLS, or this machine.
pub fn encrypted_or_local(url: &str) -> bool {
    let Some((scheme, rest)) = url.split_once("://") else {
        return false;
    };
    if matches!(scheme, "wss" | "https") {
        return true;
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let authority = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    let host = if let Some(bracketed) = authority.strip_prefix('[') {
        bracketed.split(']').next().unwrap_or("")
    } else {
        authority.split(':').next().unwrap_or("")
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Why `url` (the value of `flag`) cannot work, before anything connects:
/// not a URL, a scheme other than `schemes`, no host, a port out of range.
pub fn check_url(flag: &str, url: &str, schemes: [&str; 2]) -> Result<(), String> {
    let example = if schemes[0] == "ws" {
        "wss://HOST[:PORT]/api/v1/workers/attach"
    } else {
        "https://HOST[:PORT]/api/v1/artifacts"
    };
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(format!("{flag} {url:?} is not a URL\nhint: give {example}"));
    };
    if !schemes.contains(&scheme.to_ascii_lowercase().as_str()) {
        return Err(format!(
            "{flag} {url}: {scheme}:// is not {}\nhint: give {example}",
            if schemes[0] == "ws" {
                "a WebSocket URL"
            } else {
                "an HTTP URL"
            }
        ));
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let authority = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    let (host, port) = match authority.strip_prefix('[') {
        Some(bracketed) => match bracketed.split_once(']') {
            Some((host, after)) => (host, after.strip_prefix(':')),
            None => return Err(format!("{flag} {url}: an unclosed [ in the host")),
        },
        None => match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        },
    };
    if host.is_empty() {
        return Err(format!("{flag} {url} names no host\nhint: give {example}"));
    }
    if let Some(port) = port {
        match port.parse::<u32>() {
            Ok(1..=65535) => {}
            Ok(_) => {
                return Err(format!(
                    "{flag} {url}: port {port} is out of range (1 to 65535)"
                ));
            }
            Err(_) => return Err(format!("{flag} {url}: {port:?} is not a port number")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_never_reach_node_code() {
        for key in [
            "SECRET_KEY",
            "DATABASE_URL_RO",
            "MY_API_TOKEN",
            "db_password",
            "FLUKSIO_WORKER_TOKEN",
            "FLUKSIO_ARTIFACT_TOKEN",
            "SENTRY_DSN",
        ] {
            assert!(!allowed(key), "{key}");
        }
        for key in ["PATH", "HOME", "CUDA_VISIBLE_DEVICES", "LANG"] {
            assert!(allowed(key), "{key}");
        }
    }

    #[test]
    fn cuda_indices_are_positions_in_the_mask() {
        assert_eq!(remap_cuda("2,3", "0"), "2");
        assert_eq!(remap_cuda("2,3", "1,0"), "3,2");
        assert_eq!(remap_cuda("2,3", "5"), "5");
        assert_eq!(remap_cuda("GPU-a,GPU-b", "1"), "GPU-b");
    }

    #[test]
    fn urls_as_agent_py_reads_them() {
        assert_eq!(
            artifacts_from("wss://e.example/api/v1/workers/attach"),
            "https://e.example/api/v1/artifacts"
        );
        assert_eq!(
            artifacts_from("ws://127.0.0.1:8000/api/v1/workers/attach"),
            "http://127.0.0.1:8000/api/v1/artifacts"
        );
        assert!(encrypted_or_local("wss://e.example/x"));
        assert!(encrypted_or_local("ws://localhost:8000/x"));
        assert!(encrypted_or_local("ws://127.0.0.1/x"));
        assert!(encrypted_or_local("ws://[::1]:80/x"));
        assert!(!encrypted_or_local("ws://10.0.0.5:8000/x"));
        assert!(!encrypted_or_local("http://e.example/x"));
        assert!(!encrypted_or_local("ws://localhost.evil.example/x"));
    }

    #[test]
    fn urls_that_cannot_work_are_refused_before_connecting() {
        let ws = ["ws", "wss"];
        assert!(check_url("--url", "wss://e.example/api/v1/workers/attach", ws).is_ok());
        assert!(check_url("--url", "ws://127.0.0.1:8000/x", ws).is_ok());
        assert!(check_url("--url", "ws://[::1]:8000/x", ws).is_ok());
        assert!(
            check_url("--url", "ftp://e.example/x", ws)
                .unwrap_err()
                .contains("ftp:// is not a WebSocket URL")
        );
        assert!(
            check_url("--url", "ws://127.0.0.1:99999/x", ws)
                .unwrap_err()
                .contains("port 99999 is out of range")
        );
        assert!(check_url("--url", "ws://127.0.0.1:0/x", ws).is_err());
        assert!(check_url("--url", "ws://h:80a/x", ws).is_err());
        assert!(
            check_url("--url", "notaurl", ws)
                .unwrap_err()
                .contains("is not a URL")
        );
        assert!(
            check_url("--url", "ws:///x", ws)
                .unwrap_err()
                .contains("names no host")
        );
        assert!(check_url("--artifact-url", "ws://h/x", ["http", "https"]).is_err());
    }
}
