//! `fluksio.save_artifact` / `load_artifact`, and `fluksio-zygote fetch`:
//! the directory store against the reference, the HTTP store against a real
//! server on 127.0.0.1, hostile digests, two savers at once, and the memory
//! a 2 GiB artifact may cost.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::artifact_server::{ArtifactServer, Mode, sha256_file};
use common::{Worker, ZYGOTE, run, scratch};
use serde_json::{Value, json};

const TOKEN: &str = "s3cret-artifact-token";

fn node(body: &str) -> String {
    format!(
        "import fluksio, os, sys\ndef process(**kw):\n{}",
        indent(body)
    )
}

fn indent(body: &str) -> String {
    body.lines().map(|l| format!("    {l}\n")).collect()
}

fn call(worker: &mut Worker, body: &str, kwargs: Value) -> Value {
    worker.call(&run(1, "art", &node(body), kwargs)).reply
}

fn result(reply: &Value) -> Value {
    assert_eq!(reply["ok"], true, "{reply}");
    reply["result"].clone()
}

fn error_type(reply: &Value) -> String {
    assert_eq!(reply["ok"], false, "{reply}");
    reply["error"]["type"].as_str().unwrap().to_string()
}

/// Every file under `dir`, relative, sorted: the store's layout.
fn layout(dir: &Path) -> Vec<String> {
    fn walk(dir: &Path, base: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, base, out);
            } else {
                out.push(path.strip_prefix(base).unwrap().display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

#[test]
fn the_directory_store_matches_the_reference() {
    let files = scratch("art-files");
    std::fs::write(files.join("sample.txt"), b"file-bytes".repeat(1000)).unwrap();
    let sample = files.join("sample.txt").display().to_string();
    let cases: Vec<(&str, String, Value)> = vec![
        ("bytes, round trip", "ref = fluksio.save_artifact(b'weights-bytes', name='w.bin')\np = fluksio.load_artifact(ref)\nreturn [ref, os.path.relpath(p, os.environ['FLUKSIO_ARTIFACT_DIR']), open(p, 'rb').read().decode()]".into(), json!({})),
        ("a bytearray, default name", "return fluksio.save_artifact(bytearray(b'abc'))".into(), json!({})),
        ("a file, its basename", "ref = fluksio.save_artifact(kw['path'])\nreturn [ref, open(fluksio.load_artifact(ref), 'rb').read() == open(kw['path'], 'rb').read()]".into(), json!({"path": sample})),
        ("a name and a media type", "return fluksio.save_artifact(b'{}', name='cfg.json', media_type='application/json')".into(), json!({})),
        ("the same bytes twice", "return [fluksio.save_artifact(b'same'), fluksio.save_artifact(b'same', name='again')]".into(), json!({})),
        ("empty bytes", "return fluksio.save_artifact(b'')".into(), json!({})),
    ];
    for (name, body, kwargs) in cases {
        let (ours_dir, theirs_dir) = (scratch("art-ours"), scratch("art-ref"));
        let mut ours =
            Worker::zygote_with(&[], &[("FLUKSIO_ARTIFACT_DIR", ours_dir.to_str().unwrap())]);
        let mut theirs =
            Worker::reference_with(&[("FLUKSIO_ARTIFACT_DIR", theirs_dir.to_str().unwrap())]);
        let (a, b) = (
            call(&mut ours, &body, kwargs.clone()),
            call(&mut theirs, &body, kwargs),
        );
        assert_eq!(a, b, "{name}");
        assert_eq!(
            layout(&ours_dir),
            layout(&theirs_dir),
            "{name}: the store's layout"
        );
    }
}

#[test]
fn directory_store_errors_are_the_reference_types() {
    let dir = scratch("art-errors");
    let dir = dir.to_str().unwrap();
    let missing = format!("sha256:{}", "0".repeat(64));
    let cases = [
        (
            "an unknown digest",
            format!("return fluksio.load_artifact({{'digest': '{missing}'}})"),
            vec![("FLUKSIO_ARTIFACT_DIR", dir)],
        ),
        (
            "not a sha256 reference",
            "return fluksio.load_artifact({'digest': 'md5:abc'})".to_string(),
            vec![("FLUKSIO_ARTIFACT_DIR", dir)],
        ),
        (
            "a missing file",
            "return fluksio.save_artifact('/nowhere/at/all')".to_string(),
            vec![("FLUKSIO_ARTIFACT_DIR", dir)],
        ),
        (
            "a directory as the file",
            "return fluksio.save_artifact('/tmp')".to_string(),
            vec![("FLUKSIO_ARTIFACT_DIR", dir)],
        ),
        (
            "no store",
            "return fluksio.save_artifact(b'x')".to_string(),
            vec![],
        ),
    ];
    for (name, body, env) in cases {
        let mut ours = Worker::zygote_with(&[], &env);
        let mut theirs = Worker::reference_with(&env);
        let (a, b) = (
            call(&mut ours, &body, json!({})),
            call(&mut theirs, &body, json!({})),
        );
        assert_eq!(error_type(&a), error_type(&b), "{name}: {a}\n{b}");
        if name == "an unknown digest" {
            assert!(
                a["error"]["message"].as_str().unwrap().contains(&missing),
                "the digest is named: {a}"
            );
        }
        if name == "a missing file" || name == "no store" {
            assert_eq!(a["error"]["message"], b["error"]["message"], "{name}");
        }
    }
}

#[test]
fn hostile_digests_are_refused_before_any_path_or_request() {
    let dir = scratch("art-hostile");
    let server = ArtifactServer::start(&dir.join("server"), None);
    let cache = dir.join("cache");
    for env in [
        vec![(
            "FLUKSIO_ARTIFACT_DIR",
            dir.join("store").display().to_string(),
        )],
        vec![
            ("FLUKSIO_ARTIFACT_URL", server.url.clone()),
            ("FLUKSIO_ARTIFACT_CACHE", cache.display().to_string()),
        ],
    ] {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut worker = Worker::zygote_with(&[], &env);
        for digest in [
            "sha256:../../etc/passwd".to_string(),
            format!("sha256:{}", "A".repeat(64)),
            format!("sha256:{}", "0".repeat(63)),
            format!("md5:{}", "0".repeat(32)),
            format!("sha256:{}/../x", "0".repeat(59)),
            String::new(),
        ] {
            let reply = call(
                &mut worker,
                "return fluksio.load_artifact(kw['d'])",
                json!({"d": digest}),
            );
            assert_eq!(error_type(&reply), "ValueError", "{digest}: {reply}");
            assert!(
                reply["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("followed by 64 lowercase hex digits"),
                "the rule is named: {reply}"
            );
        }
    }
    assert!(
        server.seen().is_empty(),
        "no request was sent: {:?}",
        server.seen()
    );
    assert!(
        !cache.exists() && !dir.join("store").exists(),
        "no path was made"
    );
}

#[test]
fn two_savers_at_once_both_succeed_and_the_file_is_whole() {
    let dir = scratch("art-race");
    let store = dir.join("store");
    let source = dir.join("big.bin");
    std::fs::write(
        &source,
        (0..32 * 1024 * 1024)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<u8>>(),
    )
    .unwrap();
    let env = [("FLUKSIO_ARTIFACT_DIR", store.to_str().unwrap())];
    let mut savers: Vec<Worker> = (0..2).map(|_| Worker::zygote_with(&[], &env)).collect();
    let request = run(
        1,
        "race",
        &node("return fluksio.save_artifact(kw['path'])"),
        json!({"path": source}),
    );
    for saver in &mut savers {
        saver.send(&request);
    }
    let replies: Vec<Value> = savers.iter_mut().map(|s| s.answer().reply).collect();
    assert_eq!(result(&replies[0]), result(&replies[1]));
    let hex = sha256_file(&source);
    assert_eq!(replies[0]["result"]["digest"], format!("sha256:{hex}"));
    assert_eq!(
        layout(&store),
        vec![format!("{}/{hex}", &hex[..2])],
        "one whole file, no temporaries left"
    );
    assert_eq!(sha256_file(&store.join(&hex[..2]).join(&hex)), hex);
}

fn http_env(server: &ArtifactServer, cache: &Path, token: &str) -> Vec<(String, String)> {
    vec![
        ("FLUKSIO_ARTIFACT_URL".into(), server.url.clone()),
        ("FLUKSIO_ARTIFACT_CACHE".into(), cache.display().to_string()),
        ("FLUKSIO_ARTIFACT_TOKEN".into(), token.into()),
        ("FLUKSIO_ARTIFACT_TIMEOUT".into(), "2".into()),
    ]
}

fn http_worker(env: &[(String, String)]) -> Worker {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Worker::zygote_with(&[], &env)
}

#[test]
fn the_http_store_uploads_downloads_and_caches() {
    let dir = scratch("art-http");
    let server = ArtifactServer::start(&dir.join("server"), Some(TOKEN));
    let cache = dir.join("cache");
    let mut worker = http_worker(&http_env(&server, &cache, TOKEN));
    let file = dir.join("model.ckpt");
    std::fs::write(&file, vec![42u8; 3 * 1024 * 1024 + 17]).unwrap();

    let saved = result(&call(
        &mut worker,
        "return [fluksio.save_artifact(b'small bytes', name='a b&c.bin', media_type='text/plain'), fluksio.save_artifact(kw['path'])]",
        json!({"path": file}),
    ));
    let puts: Vec<_> = server
        .seen()
        .into_iter()
        .filter(|s| s.method == "PUT")
        .collect();
    assert_eq!(puts.len(), 2);
    assert_eq!(
        puts[0].target,
        "/artifacts?name=a+b%26c.bin&media_type=text%2Fplain"
    );
    assert_eq!(
        puts[1].target,
        "/artifacts?name=model.ckpt&media_type=application%2Foctet-stream"
    );
    for put in &puts {
        assert_eq!(
            put.headers.get("authorization"),
            Some(&format!("Bearer {TOKEN}"))
        );
        assert!(
            put.headers.contains_key("content-length"),
            "streamed with a Content-Length: {put:?}"
        );
        assert!(!put.headers.contains_key("transfer-encoding"));
    }
    assert_eq!(puts[1].body_len, 3 * 1024 * 1024 + 17);
    assert_eq!(saved[1]["digest"], format!("sha256:{}", sha256_file(&file)));
    assert_eq!(saved[1]["size"], 3 * 1024 * 1024 + 17);

    let load = "p = fluksio.load_artifact(kw['ref'])\nreturn [p, len(open(p, 'rb').read())]";
    let first = result(&call(&mut worker, load, json!({"ref": saved[1]})));
    assert_eq!(first[1], 3 * 1024 * 1024 + 17);
    assert_eq!(
        first[0],
        cache.join(sha256_file(&file)).display().to_string()
    );
    assert_eq!(server.count("GET"), 1);
    let again = result(&call(&mut worker, load, json!({"ref": saved[1]["digest"]})));
    assert_eq!(again, first);
    assert_eq!(
        server.count("GET"),
        1,
        "a cached artifact is not fetched again"
    );
}

#[test]
fn a_wrong_token_is_a_clear_refusal_that_never_shows_the_token() {
    let dir = scratch("art-token");
    let server = ArtifactServer::start(&dir.join("server"), Some("the-right-one"));
    let mut worker = http_worker(&http_env(&server, &dir.join("cache"), TOKEN));
    let reply = call(
        &mut worker,
        "fluksio.logger.info('saving')\nreturn fluksio.save_artifact(b'x')",
        json!({}),
    );
    assert_eq!(error_type(&reply), "PermissionError");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("401") && message.contains("that token is not valid here"),
        "{message}"
    );
    assert!(
        !message.contains("second line"),
        "only the first line of the body: {message}"
    );
    let (_, stderr) = worker.finish();
    assert!(
        !reply.to_string().contains(TOKEN) && !stderr.contains(TOKEN),
        "the token leaked"
    );
}

#[test]
fn corrupted_bytes_fail_verification_and_leave_the_cache_untouched() {
    let dir = scratch("art-corrupt");
    let server = ArtifactServer::start(&dir.join("server"), None);
    let source = dir.join("data.bin");
    std::fs::write(&source, b"the real bytes".repeat(1000)).unwrap();
    let digest = server.place(&source);
    server.set_mode(Mode::Corrupt);
    let cache = dir.join("cache");
    let mut worker = http_worker(&http_env(&server, &cache, ""));
    let reply = call(
        &mut worker,
        "return fluksio.load_artifact(kw['d'])",
        json!({"d": digest}),
    );
    assert_eq!(error_type(&reply), "ValueError");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&digest),
        "{reply}"
    );
    assert!(
        layout(&cache).is_empty(),
        "nothing was cached: {:?}",
        layout(&cache)
    );
    server.set_mode(Mode::Normal);
    let path = result(&call(
        &mut worker,
        "return fluksio.load_artifact(kw['d'])",
        json!({"d": digest}),
    ));
    assert_eq!(sha256_file(Path::new(path.as_str().unwrap())), digest[7..]);
}

#[test]
fn a_hung_store_times_out_and_a_missing_one_is_named() {
    let dir = scratch("art-hang");
    let server = ArtifactServer::start(&dir.join("server"), None);
    let mut worker = http_worker(&http_env(&server, &dir.join("cache"), ""));
    let missing = format!("sha256:{}", "1".repeat(64));
    let reply = call(
        &mut worker,
        "return fluksio.load_artifact(kw['d'])",
        json!({"d": missing}),
    );
    assert_eq!(error_type(&reply), "FileNotFoundError");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&missing)
    );

    server.set_mode(Mode::Hang);
    let started = std::time::Instant::now();
    let reply = call(
        &mut worker,
        "return fluksio.load_artifact(kw['d'])",
        json!({"d": missing}),
    );
    assert_eq!(error_type(&reply), "TimeoutError", "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("FLUKSIO_ARTIFACT_TIMEOUT")
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the timeout fired"
    );

    // Nothing listening: refused at once.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/artifacts", closed.local_addr().unwrap());
    drop(closed);
    let mut worker = Worker::zygote_with(&[], &[("FLUKSIO_ARTIFACT_URL", &url)]);
    let reply = call(&mut worker, "return fluksio.save_artifact(b'x')", json!({}));
    assert_eq!(error_type(&reply), "ConnectionRefusedError", "{reply}");
}

#[test]
fn node_code_cannot_read_the_token() {
    let dir = scratch("art-hidden");
    let server = ArtifactServer::start(&dir.join("server"), Some(TOKEN));
    let mut worker = http_worker(&http_env(&server, &dir.join("cache"), TOKEN));
    let found = result(&call(
        &mut worker,
        "import subprocess\nchild = subprocess.run(['env'], capture_output=True, text=True).stdout\nreturn [os.environ.get('FLUKSIO_ARTIFACT_TOKEN'), open('/proc/self/environ', 'rb').read().count(kw['t'].encode()), child.count(kw['t']), open('/proc/%d/environ' % os.getppid(), 'rb').read().count(kw['t'].encode())]",
        json!({"t": TOKEN}),
    ));
    assert_eq!(found, json!([null, 0, 0, 0]));
    // And it is still used.
    result(&call(
        &mut worker,
        "return fluksio.save_artifact(b'authorized')",
        json!({}),
    ));
}

fn fetch(env: &[(String, String)], digest: &str) -> std::process::Output {
    Command::new(ZYGOTE)
        .arg("fetch")
        .arg(digest)
        .envs(env.iter().cloned())
        .output()
        .unwrap()
}

#[test]
fn fetch_prints_the_verified_path_or_says_why_not() {
    let dir = scratch("art-fetch");
    let server = ArtifactServer::start(&dir.join("server"), Some(TOKEN));
    let source = dir.join("weights.bin");
    std::fs::write(&source, b"weights".repeat(5000)).unwrap();
    let digest = server.place(&source);
    let cache = dir.join("cache");
    let env = http_env(&server, &cache, TOKEN);
    let output = fetch(&env, &digest);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let path = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    assert_eq!(path, cache.join(&digest[7..]));
    assert_eq!(sha256_file(&path), digest[7..]);

    let output = fetch(&env, "sha256:nope");
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("64 lowercase hex digits"));
    let wrong = http_env(&server, &dir.join("cache2"), "wrong");
    let output = fetch(&wrong, &digest);
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("401") && !stderr.contains("wrong"),
        "{stderr}"
    );

    // agent.py's form of it.
    let output = Command::new(ZYGOTE)
        .args(["/x/worker_main.py", "--fetch", &digest])
        .envs(env.iter().cloned())
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        path.display().to_string()
    );
}

/// Free bytes on the filesystem holding `dir`.
fn free_bytes(dir: &Path) -> u64 {
    let stat = nix::sys::statvfs::statvfs(dir).unwrap();
    stat.blocks_available() as u64 * stat.fragment_size() as u64
}

#[test]
fn a_2_gib_artifact_costs_the_child_under_64_mib() {
    const SIZE: u64 = 2 << 30;
    let dir = scratch("art-big");
    // The store copy and the download each write 2 GiB.
    if free_bytes(&dir) < 5 * SIZE {
        println!(
            "skipped: {} has under 10 GiB free for two 2 GiB copies",
            dir.display()
        );
        return;
    }
    let big = dir.join("big.bin");
    std::fs::File::create(&big).unwrap().set_len(SIZE).unwrap();
    // Peak RSS before and after, in KiB, as the kernel counts it.
    let measure = "import resource\nbefore = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n";
    let saved_in_dir = {
        let store = dir.join("store");
        let mut worker =
            Worker::zygote_with(&[], &[("FLUKSIO_ARTIFACT_DIR", store.to_str().unwrap())]);
        result(&call(
            &mut worker,
            &format!(
                "{measure}ref = fluksio.save_artifact(kw['path'])\nreturn [ref, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before]"
            ),
            json!({"path": big}),
        ))
    };
    assert_eq!(saved_in_dir[0]["size"], SIZE);
    let grown_kib = saved_in_dir[1].as_i64().unwrap();
    println!("saving 2 GiB into a directory store raised peak RSS by {grown_kib} KiB");
    assert!(
        grown_kib < 64 * 1024,
        "saving grew peak RSS by {grown_kib} KiB"
    );

    let server = ArtifactServer::start(&dir.join("server"), None);
    let mut worker = http_worker(&http_env(&server, &dir.join("cache"), ""));
    let uploaded = result(&call(
        &mut worker,
        &format!(
            "{measure}ref = fluksio.save_artifact(kw['path'])\nreturn [ref, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before]"
        ),
        json!({"path": big}),
    ));
    let grown_kib = uploaded[1].as_i64().unwrap();
    println!("uploading 2 GiB raised peak RSS by {grown_kib} KiB");
    assert!(
        grown_kib < 64 * 1024,
        "uploading grew peak RSS by {grown_kib} KiB"
    );
    let _ = std::fs::remove_file(&big);

    let loaded = result(&call(
        &mut worker,
        &format!(
            "{measure}p = fluksio.load_artifact(kw['ref'])\nreturn [os.path.getsize(p), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before]"
        ),
        json!({"ref": uploaded[0]}),
    ));
    assert_eq!(loaded[0], SIZE);
    let grown_kib = loaded[1].as_i64().unwrap();
    println!("downloading and verifying 2 GiB raised peak RSS by {grown_kib} KiB");
    assert!(
        grown_kib < 64 * 1024,
        "downloading grew peak RSS by {grown_kib} KiB"
    );
}
