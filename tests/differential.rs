//! The same request streams to the reference `worker_main.py` and to
//! `fluksio-zygote worker`: every event and reply must match field for
//! field (timestamps aside), JSON types exact (`1` is not `1.0`: numbers are
//! compared as the text Python wrote).
//!
//! One deliberate difference is allowed, and only where a case says so: a
//! traceback of an error raised outside the node's own frames. The
//! reference's then lists `worker_main.py`'s internals (its path, its line
//! numbers); ours starts at the node's code or, with no node frame, lists
//! none. Every other field of those replies must still match, and ours must
//! not mention the runtime (PROTOCOL-NOTES.md, "Tracebacks").

mod common;

use common::{Answer, Worker};
use serde_json::{Value, json};

/// Where a case may differ from the reference.
#[derive(Clone, Copy, PartialEq)]
enum Differs {
    Nowhere,
    /// Replies whose error was raised outside node frames: the traceback.
    RuntimeFramesInTraceback,
}

struct Case {
    name: &'static str,
    requests: Vec<Value>,
    differs: Differs,
}

fn case(name: &'static str, requests: Vec<Value>) -> Case {
    Case {
        name,
        requests,
        differs: Differs::Nowhere,
    }
}

fn runtime_frames(name: &'static str, requests: Vec<Value>) -> Case {
    Case {
        name,
        requests,
        differs: Differs::RuntimeFramesInTraceback,
    }
}

fn run(node: &str, source: &str, kwargs: Value) -> Value {
    json!({"id": 1, "op": "run", "flow": "f", "node": node, "source": source, "kwargs": kwargs, "call_id": format!("r:{node}")})
}

fn compile(node: &str, source: &str) -> Value {
    json!({"id": "c", "op": "compile", "flow": "f", "node": node, "source": source})
}

fn corpus() -> Vec<Case> {
    let five_mb = "x".repeat(5 * 1024 * 1024);
    let big: Value =
        serde_json::from_str("1606938044258990275541962092341162602522202993782792835301376")
            .unwrap();
    vec![
        case("a value returned", vec![run("v", "def process(x):\n    return x * 2\n", json!({"x": 21}))]),
        case("None returned", vec![run("none", "def process():\n    pass\n", json!({}))]),
        case(
            "generator with a return value",
            vec![run(
                "g",
                "def process(n):\n    for i in range(n):\n        yield {'out': i}\n    return {'out': 'done'}\n",
                json!({"n": 3}),
            )],
        ),
        case(
            "generator without a return",
            vec![run("g0", "def process():\n    yield {'a': 1}\n    yield {'a': 2}\n", json!({}))],
        ),
        case(
            "generator raising midway",
            vec![run(
                "g1",
                "def process():\n    yield {'a': 1}\n    yield {'a': 2}\n    raise ValueError('bad batch')\n",
                json!({}),
            )],
        ),
        case(
            "generator yielding values that are not dicts",
            vec![run("g2", "def process():\n    yield 1\n    yield [1, 2.5]\n    yield 'text'\n    return None\n", json!({}))],
        ),
        case(
            "emit",
            vec![run(
                "e",
                "import fluksio\ndef process():\n    fluksio.emit(loss=0.5, step=1)\n    fluksio.emit(loss=0.25, step=2, tags=['a', {'b': None}])\n    fluksio.emit()\n    return 'trained'\n",
                json!({}),
            )],
        ),
        case(
            "emit at module level, on compile",
            vec![compile("em", "import fluksio\nfluksio.emit(ready=True)\ndef process():\n    return 1\n")],
        ),
        case(
            "logs: print, stderr, write",
            vec![run(
                "l",
                "import sys\ndef process():\n    print('a')\n    print('b', file=sys.stderr)\n    sys.stdout.write('c')\n    print('d', end='', flush=True)\n    sys.stderr.writelines(['e', 'f\\n'])\n    return 1\n",
                json!({}),
            )],
        ),
        case(
            "logs capped at 16 KiB",
            vec![run("cap", "def process():\n    print('x' * 20000)\n    print('after')\n    return 1\n", json!({}))],
        ),
        case(
            "logs capped in characters, not bytes",
            vec![run("capu", "def process():\n    print('é' * 10000)\n    print('日本' * 5000)\n    return 1\n", json!({}))],
        ),
        case(
            "logs capped across many writes",
            vec![run("capn", "def process():\n    for i in range(5000):\n        print(i)\n    return 1\n", json!({}))],
        ),
        case(
            "fluksio.logger",
            vec![run(
                "log",
                "import fluksio\ndef process():\n    fluksio.logger.info('n=%d', 3)\n    fluksio.logger.debug('hidden')\n    fluksio.logger.warning('careful')\n    print('between')\n    fluksio.logger.error('e: %s', {'k': 1})\n    return 1\n",
                json!({}),
            )],
        ),
        case(
            "an error: short line and trimmed traceback",
            vec![run(
                "err",
                "def helper(d):\n    return d['missing']\n\ndef process():\n    print('before')\n    return helper({})\n",
                json!({}),
            )],
        ),
        case(
            "an error with an empty and a unicode message",
            vec![
                run("err0", "def process():\n    raise RuntimeError()\n", json!({})),
                run("err1", "def process():\n    raise ValueError('é 日本 🙂')\n", json!({})),
            ],
        ),
        case(
            "an error at module level, on compile",
            vec![compile("modf", "print('loading')\nx = 1 / 0\ndef process():\n    return 1\n")],
        ),
        runtime_frames("a SyntaxError on compile", vec![compile("syn", "def process(:\n    return 1\n")]),
        runtime_frames("a SyntaxError on run", vec![run("syn2", "x = (\ndef process():\n    return 1\n", json!({}))]),
        runtime_frames(
            "an IndentationError",
            vec![compile("ind", "def process():\nreturn 1\n")],
        ),
        case("a set returned", vec![run("set", "def process():\n    return {1, 2}\n", json!({}))]),
        case("bytes returned", vec![run("bytes", "def process():\n    return b'raw'\n", json!({}))]),
        case("tuple keys returned", vec![run("tk", "def process():\n    return {(1, 2): 3}\n", json!({}))]),
        case(
            "NaN nested deep",
            vec![run("nan", "def process():\n    return {'a': [1, {'b': [2, float('nan')]}]}\n", json!({}))],
        ),
        case("an infinity returned", vec![run("inf", "def process():\n    return -float('inf')\n", json!({}))]),
        case(
            "a RecursionError while encoding",
            vec![run(
                "rec",
                "def process():\n    x = []\n    for _ in range(100000):\n        x = [x]\n    return x\n",
                json!({}),
            )],
        ),
        case(
            "a circular reference",
            vec![run("circ", "def process():\n    x = []\n    x.append(x)\n    return x\n", json!({}))],
        ),
        case("an object returned", vec![run("obj", "def process():\n    return object()\n", json!({}))]),
        case(
            "non-string dict keys",
            vec![run(
                "keys",
                "def process():\n    return {1: 'a', 2.5: 'b', True: 'c', None: 'd', -0.0: 'z', 10**30: 'big'}\n",
                json!({}),
            )],
        ),
        case(
            "big ints both ways",
            vec![run("bigint", "def process(n):\n    return [n * 3, str(n), -n]\n", json!({"n": big}))],
        ),
        case(
            "floats, -0.0 and the extremes",
            vec![run(
                "floats",
                "def process(z, small, large):\n    return [z, -0.0, small, large, 1e-7, 0.1 + 0.2, 2.0, 1.5e300 * 10, [type(z).__name__]]\n",
                json!({"z": -0.0, "small": 5e-324, "large": 1.7976931348623157e308}),
            )],
        ),
        case(
            "unicode both ways",
            vec![run(
                "uni",
                "def process(s):\n    print(s)\n    return {s: len(s), 'echo': s, 'escapes': '\\u2028\\x00\\t\"'}\n",
                json!({"s": "é日本🙂\u{2028}"}),
            )],
        ),
        case(
            "5 MB both ways",
            vec![run(
                "big",
                "def process(blob):\n    return {'len': len(blob), 'echo': blob}\n",
                json!({"blob": five_mb}),
            )],
        ),
        runtime_frames(
            "keep: false compiles without evicting the published source",
            vec![
                compile("keep", "print('loaded')\ndef process():\n    return 'published'\n"),
                json!({"id": 2, "op": "compile", "flow": "f", "node": "keep", "source": "def process():\n    return 'draft'\n", "keep": false}),
                json!({"id": 3, "op": "compile", "flow": "f", "node": "keep", "source": "print('draft')\ndef process(:\n", "keep": false}),
                run("keep", "print('loaded')\ndef process():\n    return 'published'\n", json!({})),
            ],
        ),
        case(
            "recompilation on a new source",
            vec![
                compile("re", "print('v1 loads')\ndef process():\n    return 1\n"),
                run("re", "print('v1 loads')\ndef process():\n    return 1\n", json!({})),
                compile("re", "print('v2 loads')\ndef process():\n    return 2\n"),
                run("re", "print('v2 loads')\ndef process():\n    return 2\n", json!({})),
                compile("re", "print('v2 loads')\ndef process():\n    return 2\n"),
                run("re", "print('v1 loads')\ndef process():\n    return 1\n", json!({})),
            ],
        ),
        case(
            "a run without a compile loads and keeps the node",
            vec![
                run("lazy", "print('module code')\ndef process(x):\n    print('call', x)\n    return x\n", json!({"x": 1})),
                run("lazy", "print('module code')\ndef process(x):\n    print('call', x)\n    return x\n", json!({"x": 2})),
            ],
        ),
        case(
            "module naming",
            vec![run(
                "naming",
                "import sys\ndef process():\n    mod = sys.modules[__name__]\n    return [__name__, process.__module__, type(mod).__name__, process.__code__.co_filename, __file__ if '__file__' in globals() else None, sorted(k for k in sys.modules if k.startswith('_fluksio_node_'))]\n",
                json!({}),
            )],
        ),
        case(
            "a stray os.write(1)",
            vec![run(
                "stray",
                "import os\ndef process():\n    os.write(1, b'junk\\n')\n    print('still captured')\n    return 'clean'\n",
                json!({}),
            )],
        ),
        case(
            "ids and call ids of every kind",
            vec![
                json!({"id": "abc", "op": "run", "flow": "f", "node": "id", "source": "def process():\n    yield {'a': 1}\n    return 1\n", "call_id": "run-7:f.id"}),
                json!({"op": "run", "flow": "f", "node": "id", "source": "def process():\n    yield {'a': 1}\n    return 1\n"}),
                json!({"id": {"a": [1, null]}, "op": "run", "flow": "f", "node": "id", "source": "def process():\n    return 1\n", "call_id": null}),
                json!({"id": 1.5, "op": "run", "flow": "f", "node": "id", "source": "def process():\n    return 1\n", "call_id": 7}),
                serde_json::from_str::<Value>(r#"{"id": 123456789012345678901234567890, "op": "run", "flow": "f", "node": "id", "source": "def process():\n    return 1\n", "run": {"id": "r1"}}"#).unwrap(),
            ],
        ),
        case(
            "kwargs absent, null and falsy",
            vec![
                json!({"id": 1, "op": "run", "flow": "f", "node": "kw", "source": "def process(**kw):\n    return kw\n"}),
                json!({"id": 2, "op": "run", "flow": "f", "node": "kw", "source": "def process(**kw):\n    return kw\n", "kwargs": null}),
                json!({"id": 3, "op": "run", "flow": "f", "node": "kw", "source": "def process(**kw):\n    return kw\n", "kwargs": []}),
                json!({"id": 4, "op": "run", "flow": "f", "node": "kw", "source": "def process(**kw):\n    return kw\n", "kwargs": {"a": [1, {"b": 2}]}}),
            ],
        ),
        runtime_frames(
            "kwargs that are not a mapping",
            vec![run("kwl", "def process(*a):\n    return a\n", json!([1, 2]))],
        ),
        runtime_frames(
            "an unexpected keyword argument",
            vec![run("kwu", "def process(x):\n    return x\n", json!({"y": 1}))],
        ),
        case(
            "the one public function, when there is no process",
            vec![run("one", "def _helper():\n    return 1\n\ndef main(y):\n    return y + _helper()\n", json!({"y": 1}))],
        ),
        runtime_frames(
            "two public functions and no process",
            vec![compile("two", "def a():\n    return 1\n\ndef b():\n    return 2\n")],
        ),
        case(
            "a class as the only public callable",
            vec![run("cls", "class Model:\n    def __init__(self, x):\n        self.x = x\n    def __repr__(self):\n        return 'Model'\n", json!({"x": 1}))],
        ),
        case(
            "process that is not callable falls back to the one function",
            vec![run("ncall", "process = 3\ndef run_it():\n    return 'ran'\n", json!({}))],
        ),
        case(
            "annotations are postponed",
            vec![run(
                "ann",
                "def process(x: UndefinedType) -> 'Result':\n    return process.__annotations__\n",
                json!({"x": 1}),
            )],
        ),
        case(
            "the authoring API is inert",
            vec![run(
                "author",
                "from fluksio import Port, node, use, Flow\nimport fluksio\nport = Port(int, default=3)\nflow = Flow('demo')\nflow.anything.at_all(1)\nstep = use('other', x=port)\n@node(outputs={'y': Port(float)})\ndef process(x):\n    return [x, repr(port), repr(flow.stage), callable(step)]\n",
                json!({"x": 2}),
            )],
        ),
        runtime_frames(
            "emit of a value JSON cannot carry",
            vec![run("emitset", "import fluksio\ndef process():\n    fluksio.emit(s={1, 2})\n    return 1\n", json!({}))],
        ),
        runtime_frames(
            "a yield JSON cannot carry",
            vec![run("yieldset", "def process():\n    yield {'a': 1}\n    yield {'s': {1}}\n    return 1\n", json!({}))],
        ),
        case(
            "a node replacing sys.stdout keeps what it printed before",
            vec![run(
                "swap",
                "import io, sys\ndef process():\n    print('kept')\n    sys.stdout = io.StringIO()\n    print('lost')\n    return 1\n",
                json!({}),
            )],
        ),
    ]
}

/// Drops what legitimately differs between two runs: event timestamps,
/// and (where the case allows) the traceback of the reply.
fn normalize(mut answer: Answer, without_traceback: bool) -> Answer {
    for event in &mut answer.events {
        let ts = event.as_object_mut().and_then(|o| o.remove("ts"));
        assert!(
            ts.as_ref().is_some_and(Value::is_number),
            "an event has a numeric ts: {event}"
        );
    }
    if without_traceback
        && let Some(error) = answer.reply.get_mut("error").and_then(Value::as_object_mut)
    {
        error.remove("traceback");
    }
    answer
}

fn serve(mut worker: Worker, requests: &[Value]) -> Vec<Answer> {
    let mut answers = Vec::new();
    for request in requests {
        // Blank lines in between are skipped by both.
        worker.send_line(b"");
        worker.send_line(b"   ");
        answers.push(worker.call(request));
    }
    answers
}

fn check(case: &Case, args: &[&str], env: &[(&str, &str)]) -> Result<(), String> {
    let reference = serve(Worker::reference(), &case.requests);
    let ours = serve(Worker::zygote_with(args, env), &case.requests);
    for (index, (theirs, ours)) in reference.into_iter().zip(ours).enumerate() {
        let loose =
            case.differs == Differs::RuntimeFramesInTraceback && theirs.reply["ok"] == false;
        if loose {
            let traceback = ours.reply["error"]["traceback"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            if !traceback.starts_with("Traceback (most recent call last):\n")
                || traceback.contains("worker_main")
                || traceback.contains(".rs")
            {
                return Err(format!(
                    "request {index}: our traceback shows the runtime: {traceback:?}"
                ));
            }
        }
        let (theirs, ours) = (normalize(theirs, loose), normalize(ours, loose));
        if theirs != ours {
            return Err(format!(
                "request {index} differs\n  reference: {}\n  ours:      {}",
                shorten(&format!("{theirs:?}")),
                shorten(&format!("{ours:?}"))
            ));
        }
    }
    Ok(())
}

fn shorten(text: &str) -> String {
    if text.len() > 3000 {
        format!(
            "{}… ({} bytes)",
            &text[..text.floor_char_boundary(3000)],
            text.len()
        )
    } else {
        text.to_string()
    }
}

#[test]
fn every_case_matches_the_reference_field_for_field() {
    every_case_matches(&[], &[], &[]);
}

/// Through pool slots sharing one zygote (every case's slot shares it,
/// two cases at a time): the same replies.
#[test]
fn every_case_matches_the_reference_through_slots_of_a_shared_zygote() {
    every_case_matches(
        &[],
        &[
            ("FLUKSIO_SHARED_ZYGOTE", "1"),
            ("FLUKSIO_TEST_SCOPE", "differential"),
            ("FLUKSIO_SHARED_ZYGOTE_LINGER_S", "2"),
        ],
        // Every node has a zygote of its own there: its `sys.modules` holds
        // no other slot's node, as a worker of its own would.
        &[],
    );
}

/// With a child per node serving its calls in turn, as a reused
/// `worker_main.py` does: the same replies.
#[test]
fn every_case_matches_the_reference_with_a_child_per_node() {
    every_case_matches(&["--isolation", "node"], &[], &[]);
}

/// With a child per node put back after each call (`--isolation reset`):
/// the same replies.
#[test]
fn every_case_matches_the_reference_with_a_child_per_node_put_back() {
    every_case_matches(&["--isolation", "reset"], &[], &[]);
}

fn every_case_matches(args: &[&str], env: &[(&str, &str)], differ_by_design: &[&str]) {
    let cases: Vec<Case> = corpus()
        .into_iter()
        .filter(|case| !differ_by_design.contains(&case.name))
        .collect();
    // Two at a time: each case starts a reference and a zygote of its own.
    let failures: Vec<String> = std::thread::scope(|scope| {
        let chunks: Vec<&[Case]> = cases.chunks(cases.len().div_ceil(2)).collect();
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|chunk| {
                scope.spawn(move || {
                    chunk
                        .iter()
                        .filter_map(|case| {
                            check(case, args, env)
                                .err()
                                .map(|e| format!("{}: {e}", case.name))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("no panic"))
            .collect()
    });
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n\n")
    );
}
