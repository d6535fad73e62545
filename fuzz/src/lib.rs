//! Fuzz targets for every parser that reads untrusted input: the IDX reader, the checkpoint
//! manifest and trainer-state parsers, the safetensors weights path, the `--algorithms` list
//! and the time strings. Each target takes bytes and must neither panic nor allocate far
//! beyond its input; where it accepts the input it checks an invariant (a round trip, a size
//! that agrees with the header). It returns a short class of its outcome, which the runner
//! uses to keep inputs that reach new outcomes.
//!
//! Why not `cargo fuzz`: libFuzzer's coverage instrumentation needs a nightly toolchain, and
//! these machines have one stable toolchain and no way to fetch another. The runner
//! (`src/main.rs`) is a plain mutation fuzzer guided by outcome classes; `cargo test` replays
//! the corpus in `fuzz/corpus/` and a bounded number of mutations of it.

pub mod guard;
pub mod mutate;

use std::path::Path;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use flashover::algorithms::augment::Normalization;
use flashover::algorithms::spec::{build_image_classification, parse_list};
use flashover::backend::Flex;
use flashover::checkpoint::format::{
    parse_manifest, FileEntry, Manifest, FORMAT_NAME, FORMAT_VERSION,
};
use flashover::checkpoint::{load_weights_bytes, weights_to_bytes, TrainerStateFile, WeightsLoad};
use flashover::core::data::{parse_idx_images, parse_idx_labels};
use flashover::core::time::Time;

/// A fuzz target: a name, the function under test, its built-in seeds and a dictionary of
/// tokens its format is made of.
pub struct Target {
    /// Name on the command line and of the corpus folder.
    pub name: &'static str,
    /// Runs one input; panics on a bug; returns the outcome's class.
    pub run: fn(&[u8]) -> String,
    /// Valid (and some invalid) inputs to start from.
    pub seeds: fn() -> Vec<Vec<u8>>,
    /// Tokens to insert.
    pub dict: &'static [&'static [u8]],
}

/// Every target.
pub const TARGETS: &[Target] = &[
    Target {
        name: "uri",
        run: uri,
        seeds: uri_seeds,
        dict: &[
            b"s3://", b"gs://", b"az://", b"/", b"..", b".", b"%2F", b"?", b"#", b"\0",
        ],
    },
    Target {
        name: "idx",
        run: idx,
        seeds: idx_seeds,
        dict: &[
            &[0, 0, 8, 3],
            &[0, 0, 8, 1],
            &[0x1f, 0x8b, 8, 0],
            &[0, 0, 0, 28],
            &[0xff, 0xff, 0xff, 0xff],
        ],
    },
    Target {
        name: "manifest",
        run: manifest,
        seeds: manifest_seeds,
        dict: &[
            b"\"files\"",
            b"\"name\"",
            b"\"../\"",
            b"\"manifest.json\"",
            b"\"version\":",
            b"\"bytes\":",
            b"18446744073709551615",
            b"-1",
            b"null",
            b"[]",
            b"{}",
            b"\"/etc/passwd\"",
            b"\"a/b\"",
            b"\"\"",
        ],
    },
    Target {
        name: "trainer_state",
        run: trainer_state,
        seeds: trainer_state_seeds,
        dict: &[
            b"\"timestamp\"",
            b"\"sampler\"",
            b"\"batch_in_epoch\":",
            b"\"epoch\":",
            b"18446744073709551615",
            b"1e308",
            b"-0.0",
            b"null",
            b"{}",
            b"[]",
        ],
    },
    Target {
        name: "safetensors",
        run: safetensors,
        seeds: safetensors_seeds,
        dict: &[
            b"\"dtype\":\"F32\"",
            b"\"dtype\":\"F16\"",
            b"\"dtype\":\"I64\"",
            b"\"shape\":[",
            b"\"data_offsets\":[",
            b"4294967295",
            b"18446744073709551615",
            b"\"__metadata__\"",
            b"weight",
            b"bias",
        ],
    },
    Target {
        name: "algorithms",
        run: algorithms,
        seeds: algorithms_seeds,
        dict: &[
            b",",
            b":",
            b"=",
            b"label_smoothing",
            b"mixup",
            b"cutmix",
            b"cutout",
            b"colout",
            b"progressive_resizing",
            b"randaugment",
            b"augmix",
            b"selective_backprop",
            b"gradient_clipping",
            b"ema",
            b"swa",
            b"sam",
            b"layer_freezing",
            b"num_holes=",
            b"length=",
            b"alpha=",
            b"depth=",
            b"width=",
            b"severity=",
            b"half_life=",
            b"1e308",
            b"NaN",
            b"inf",
            b"-1",
            b"0.5dur",
            b"100tok",
            b"18446744073709551615",
        ],
    },
    Target {
        name: "time",
        run: time,
        seeds: time_seeds,
        dict: &[
            b"ep",
            b"ba",
            b"sp",
            b"tok",
            b"dur",
            b"h",
            b"m",
            b"s",
            b"_",
            b".",
            b"e",
            b"e-",
            b"e308",
            b"-",
            b"+",
            b"1",
            b"0",
            b"NaN",
            b"inf",
            b"18446744073709551615",
            b" ",
        ],
    },
];

/// The target named `name`.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

/// A short class of an error message: its first words with numbers and quoted values
/// removed, so that "truncated: 12 bytes" and "truncated: 40 bytes" are one class.
pub fn class_of(message: &str) -> String {
    let mut out = String::new();
    let (mut quoted, mut escaped) = (false, false);
    for c in message.chars() {
        if quoted && escaped {
            escaped = false;
            continue;
        }
        if quoted && c == '\\' {
            escaped = true;
            continue;
        }
        if c == '"' {
            quoted = !quoted;
            continue;
        }
        if quoted || c.is_ascii_digit() {
            continue;
        }
        out.push(c);
        if out.len() >= 120 {
            break;
        }
    }
    format!("err: {out}")
}

fn outcome<T, E: std::fmt::Display>(r: &Result<T, E>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(e) => class_of(&e.to_string()),
    }
}

fn idx(bytes: &[u8]) -> String {
    let images = parse_idx_images(bytes);
    if let Ok(i) = &images {
        assert_eq!(
            i.pixels.len(),
            i.count * i.rows * i.cols,
            "pixels disagree with the header"
        );
    }
    let labels = parse_idx_labels(bytes);
    if let Ok(l) = &labels {
        // The header's count is the payload's length.
        let n = u32::from_be_bytes(
            decompressed_head(bytes)[4..8]
                .try_into()
                .unwrap_or_default(),
        );
        assert_eq!(l.len(), n as usize, "labels disagree with the header");
    }
    format!("images {}; labels {}", outcome(&images), outcome(&labels))
}

/// The first 8 decompressed bytes of an IDX input that parsed (so at least 8 exist).
fn decompressed_head(bytes: &[u8]) -> Vec<u8> {
    use std::io::Read;
    let mut head = vec![0u8; 8];
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let _ = flate2::read::GzDecoder::new(bytes).read_exact(&mut head);
    } else {
        head.copy_from_slice(&bytes[..8]);
    }
    head
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let _ = gz.write_all(bytes);
    gz.finish().unwrap_or_default()
}

fn idx_seeds() -> Vec<Vec<u8>> {
    let mut images = vec![0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 2];
    images.extend(0..12u8);
    let mut labels = vec![0, 0, 8, 1, 0, 0, 0, 3];
    labels.extend([7, 2, 1]);
    vec![gzip(&images), gzip(&labels), images, labels]
}

fn manifest(bytes: &[u8]) -> String {
    let r = parse_manifest(bytes, Path::new("<fuzz>/manifest.json"));
    if let Ok(m) = &r {
        for f in &m.files {
            let p = Path::new(&f.name);
            assert!(
                p.components().count() == 1
                    && !f.name.contains(['/', '\\'])
                    && f.name != ".."
                    && f.name != "."
                    && f.name != "manifest.json"
                    && !f.name.is_empty(),
                "unsafe entry {:?} accepted",
                f.name
            );
        }
    }
    outcome(&r)
}

fn manifest_seeds() -> Vec<Vec<u8>> {
    let m = Manifest {
        format: FORMAT_NAME.into(),
        version: FORMAT_VERSION,
        epoch: 3,
        batch: 375,
        weights_only: false,
        files: ["model.safetensors", "optimizer.mpk", "trainer_state.json"]
            .iter()
            .map(|n| FileEntry {
                name: n.to_string(),
                bytes: 1234,
                sha256: "ab".repeat(32),
            })
            .collect(),
    };
    vec![
        serde_json::to_vec_pretty(&m).unwrap_or_default(),
        serde_json::to_vec(&m).unwrap_or_default(),
    ]
}

fn trainer_state(bytes: &[u8]) -> String {
    let path = Path::new("<fuzz>/trainer_state.json");
    let r = TrainerStateFile::parse(bytes, path);
    if let Ok(s) = &r {
        // What was accepted writes back and reads again as the same state.
        let text = serde_json::to_vec(s).expect("an accepted state serialises");
        let again = TrainerStateFile::parse(&text, path).expect("a written state parses");
        assert_eq!(&again, s, "trainer state does not round-trip");
    }
    outcome(&r)
}

fn trainer_state_seeds() -> Vec<Vec<u8>> {
    // Real files are in the corpus; this one is written here so the target has a seed even
    // without it.
    let text = r#"{"timestamp":{"epoch":1,"batch":20,"sample":640,"token":0,"batch_in_epoch":4,"sample_in_epoch":128,"token_in_epoch":0,"total_wall_time":{"secs":1,"nanos":5},"epoch_wall_time":{"secs":0,"nanos":7},"batch_wall_time":{"secs":0,"nanos":9}},"sampler":{"epoch":1,"batch_in_epoch":4},"seed":7,"rank":0,"world_size":1,"base_lr":0.003,"lr":0.003,"max_duration":"3ep","scheduler":"Constant","skipped_batches":0,"last_eval_batch":16,"eval_metrics":{"test":{"accuracy":0.5,"loss":null}},"param_ids":{"conv1.weight":12},"components":{"ema":{"last":3.0}}}"#;
    vec![text.as_bytes().to_vec()]
}

/// A small model whose weights file the safetensors target loads.
#[derive(Module, Debug)]
pub struct Tiny<B: burn::tensor::backend::Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
}

fn tiny() -> Tiny<Flex> {
    let d = Default::default();
    Tiny {
        fc1: LinearConfig::new(3, 4).init(&d),
        fc2: LinearConfig::new(4, 2).with_bias(false).init(&d),
    }
}

fn safetensors(bytes: &[u8]) -> String {
    let path = Path::new("<fuzz>/model.safetensors");
    let strict = load_weights_bytes(tiny(), bytes.to_vec(), path, &WeightsLoad::default());
    let loose = WeightsLoad {
        non_strict: true,
        ignore_keys: vec!["fc2.*".into()],
    };
    let lenient = load_weights_bytes(tiny(), bytes.to_vec(), path, &loose);
    if let Ok((m, _)) = &strict {
        assert_eq!(m.fc1.weight.dims(), [3, 4], "a loaded tensor changed shape");
    }
    format!("strict {}; lenient {}", outcome(&strict), outcome(&lenient))
}

fn safetensors_seeds() -> Vec<Vec<u8>> {
    vec![weights_to_bytes::<Flex, _>(&tiny()).unwrap_or_default()]
}

/// The setup the example's algorithms are built for.
type MnistSetup = flashover::core::setup::SetupOf<
    flashover::backend::Autodiff<Flex>,
    flashover_examples::MnistCnn<flashover::backend::Autodiff<Flex>>,
    burn::optim::adaptor::OptimizerAdaptor<
        burn::optim::AdamW,
        flashover_examples::MnistCnn<flashover::backend::Autodiff<Flex>>,
        flashover::backend::Autodiff<Flex>,
    >,
>;

fn algorithms(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let specs = match parse_list(&text) {
        Ok(s) => s,
        Err(e) => return class_of(&e.to_string()),
    };
    // What was accepted prints as a list that parses to the same specs.
    let printed: Vec<String> = specs.iter().map(|s| s.to_string()).collect();
    let again = parse_list(&printed.join(",")).expect("a printed list parses");
    assert_eq!(again, specs, "algorithm list does not round-trip");
    let norm = Normalization {
        mean: vec![0.1307],
        std: vec![0.3081],
    };
    let mut classes = Vec::new();
    for s in &specs {
        let built = build_image_classification::<MnistSetup>(s, &norm);
        classes.push(outcome(&built));
    }
    classes.join("; ")
}

fn algorithms_seeds() -> Vec<Vec<u8>> {
    [
        "label_smoothing,mixup:alpha=0.2,ema:half_life=100ba",
        "cutout:num_holes=2:length=0.3",
        "randaugment:depth=2:severity=9,augmix:width=3:depth=-1",
        "progressive_resizing,selective_backprop,gradient_clipping",
        "swa,sam,layer_freezing,colout,cutmix",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

fn time(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let r = text.parse::<Time>();
    if let Ok(t) = &r {
        let again: Time = t.to_string().parse().expect("a printed time parses");
        assert_eq!(
            &again, t,
            "time {text:?} prints as {t} which reads back differently"
        );
    }
    outcome(&r)
}

fn time_seeds() -> Vec<Vec<u8>> {
    [
        "6ep", "500ba", "20_000sp", "1e6tok", "0.3dur", "1h30m", "45m", "90s", "1h0m1s",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

fn uri(bytes: &[u8]) -> String {
    use flashover::checkpoint::remote::{check_segment, Location, RemoteUri};
    let text = String::from_utf8_lossy(bytes);
    let r = Location::parse(&text);
    if let Ok(Location::Remote(u)) = &r {
        let again = RemoteUri::parse(&u.to_string()).expect("a printed URI parses");
        assert_eq!(
            &again, u,
            "URI {text:?} prints as {u} which reads back differently"
        );
        for s in u.prefix() {
            assert!(check_segment(s).is_ok(), "{text:?} kept the segment {s:?}");
        }
        assert!(
            u.cache_path()
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_))),
            "{text:?} caches outside its folder: {}",
            u.cache_path().display()
        );
    }
    outcome(&r)
}

fn uri_seeds() -> Vec<Vec<u8>> {
    [
        "s3://runs/mnist/ck",
        "s3://runs/mnist/ck/",
        "gs://my-bucket/a=1/b_2",
        "az://container/x",
        "s3://runs/../x",
        "s3://Runs/x",
        "ftp://runs",
        "checkpoints",
        "s3://runs/a//b",
        "s3://runs/ep3-ba375/latest",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

/// The corpus files of a target (`fuzz/corpus/<name>/`), in name order.
pub fn corpus(name: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(name);
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_type().map(|t| t.is_file()).unwrap_or(false))
                .filter_map(|e| {
                    let bytes = std::fs::read(e.path()).ok()?;
                    Some((e.file_name().to_string_lossy().into_owned(), bytes))
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// Hex SHA-256 of an input, its file name in the corpus and among findings.
pub fn name_of(input: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(input)
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}
