//! A store on this machine's filesystem: `<dir>/<hex[0:2]>/<hex>`.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::digest::{self, Digest};
use super::{ArtifactError, Saved, Source, Temporary, io, temporary_beside};

pub fn target(dir: &Path, digest: &Digest) -> PathBuf {
    dir.join(digest.fan_out()).join(digest.hex())
}

/// Writes into a temporary file in the store and renames it into place
/// unless the artifact is there already: an existing artifact is never
/// rewritten, and two savers racing both rename a whole file over the same
/// bytes. A file is read once, hashed on the way through.
pub fn save(dir: &Path, source: Source<'_>) -> Result<Saved, ArtifactError> {
    std::fs::create_dir_all(dir).map_err(io("create", dir))?;
    // Named in the store's root: the fan-out directory depends on the
    // digest, known only at the end. Same filesystem, so the rename is atomic.
    let (mut out, temporary) = temporary_beside(&dir.join("incoming"))?;
    let temporary = Temporary(Some(temporary));
    let (digest, size) = match source {
        Source::Bytes(bytes) => {
            out.write_all(bytes).map_err(io("write into", dir))?;
            (digest::of_bytes(bytes), bytes.len() as u64)
        }
        Source::File(path) => {
            let mut file = std::fs::File::open(path).map_err(io("open", path))?;
            digest::copy_hashing(&mut file, &mut out).map_err(|failed| match failed {
                digest::Failed::Reading(error) => io("read", path)(error),
                digest::Failed::Writing(error) => io("write into", dir)(error),
            })?
        }
    };
    drop(out);
    let target = target(dir, &digest);
    if !target.exists() {
        let parent = target.parent().expect("a fan-out directory");
        std::fs::create_dir_all(parent).map_err(io("create", parent))?;
        temporary.rename_to(&target)?;
    }
    Ok(Saved { digest, size })
}

pub fn load(dir: &Path, digest: &Digest) -> Result<PathBuf, ArtifactError> {
    let target = target(dir, digest);
    if !target.exists() {
        return Err(ArtifactError::NotFound {
            digest: digest.clone(),
            place: dir.display().to_string(),
        });
    }
    Ok(target)
}
