//! Images and files for the loggers: PNG encoding (the `png` crate) and the folder the file
//! loggers keep them in (`media/` beside their log file): `images/<tag>/<batch>.png` and
//! `files/<name>`, each written under a temporary name and renamed into place, so a reader
//! never sees half a file.

use std::path::{Path, PathBuf};

use flashover_core::logger::Image;

use crate::error::{CallbackError, Result};

/// `image` as a PNG file's bytes (8 bits per channel; grey, RGB or RGBA as the image is).
pub fn encode_png(image: &Image) -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut out, image.width(), image.height());
        encoder.set_color(match image.channels() {
            1 => png::ColorType::Grayscale,
            3 => png::ColorType::Rgb,
            _ => png::ColorType::Rgba,
        });
        encoder.set_depth(png::BitDepth::Eight);
        // Writing into a Vec fails only on an image whose size does not match its pixels,
        // which `Image::new` rules out.
        let mut writer = encoder
            .write_header()
            .expect("a PNG header for a checked image");
        // As above: the data's length is the header's size, checked by `Image::new`.
        writer
            .write_image_data(image.pixels())
            .expect("PNG data for a checked image");
    }
    out
}

/// A tag as a relative folder path: its `/`-separated parts kept, characters other than
/// letters, digits, `.`, `_` and `-` replaced by `_`, and parts that would leave the folder
/// (`.`, `..`, empty) replaced by `_`.
pub fn tag_path(tag: &str) -> PathBuf {
    tag.split('/')
        .map(|part| {
            let clean: String = part
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                        c
                    } else {
                        '_'
                    }
                })
                .collect();
            if clean.is_empty() || clean == "." || clean == ".." {
                "_".to_string()
            } else {
                clean
            }
        })
        .collect()
}

/// Where an image logged under `tag` at `batch` is kept, relative to a logger's folder or
/// run: `images/<tag>/<batch, 8 digits>.png` (the file loggers and MLflow use the same names).
pub fn image_name(tag: &str, batch: u64) -> String {
    format!("images/{}/{batch:08}.png", tag_path(tag).to_string_lossy())
}

/// Where a text logged under `tag` at `batch` is kept: `text/<tag>/<batch, 8 digits>.txt`.
pub fn text_name(tag: &str, batch: u64) -> String {
    format!("text/{}/{batch:08}.txt", tag_path(tag).to_string_lossy())
}

/// The folder a file logger keeps images and files in.
#[derive(Debug, Clone)]
pub struct MediaFolder {
    component: &'static str,
    dir: PathBuf,
}

impl MediaFolder {
    /// The folder `dir` (created on the first write), for `component`'s errors.
    pub fn new(component: &'static str, dir: impl Into<PathBuf>) -> Self {
        MediaFolder {
            component,
            dir: dir.into(),
        }
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes `image` as [`image_name`]; returns that relative path.
    pub fn write_image(&self, tag: &str, batch: u64, image: &Image) -> Result<PathBuf> {
        let rel = PathBuf::from(image_name(tag, batch));
        self.write(&rel, &encode_png(image))?;
        Ok(rel)
    }

    /// Copies the file at `path` to `files/<name>`; returns that relative path. (`name` was
    /// checked by the logger: plain relative parts.)
    pub fn copy_file(&self, name: &str, path: &Path) -> Result<PathBuf> {
        let rel = Path::new("files").join(name);
        self.write_with(&rel, |tmp| {
            std::fs::copy(path, tmp).map(|_| ()).map_err(|e| {
                std::io::Error::new(e.kind(), format!("copying {}: {e}", path.display()))
            })
        })?;
        Ok(rel)
    }

    fn write(&self, rel: &Path, bytes: &[u8]) -> Result<()> {
        self.write_with(rel, |tmp| std::fs::write(tmp, bytes))
    }

    /// Creates the file at `rel` through `fill` (given a temporary path beside it), then
    /// renames it into place.
    fn write_with(
        &self,
        rel: &Path,
        fill: impl FnOnce(&Path) -> std::io::Result<()>,
    ) -> Result<()> {
        let path = self.dir.join(rel);
        let io = |p: &Path, e| CallbackError::io(self.component, p, e);
        let dir = path.parent().unwrap_or(&self.dir);
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
        fill(&tmp).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io(&tmp, e)
        })?;
        std::fs::rename(&tmp, &path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io(&path, e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn png_decodes_to_the_same_pixels() {
        for channels in [1u8, 3, 4] {
            let (w, h) = (5u32, 3u32);
            let pixels: Vec<u8> = (0..w * h * channels as u32)
                .map(|i| (i * 17 % 251) as u8)
                .collect();
            let image = Image::new(w, h, channels, pixels.clone()).unwrap();
            let bytes = encode_png(&image);
            let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
            let mut reader = decoder.read_info().unwrap();
            let mut buf = vec![0; reader.output_buffer_size()];
            let info = reader.next_frame(&mut buf).unwrap();
            assert_eq!((info.width, info.height), (w, h));
            assert_eq!(info.color_type.samples(), channels as usize);
            assert_eq!(&buf[..info.buffer_size()], &pixels[..]);
        }
    }

    #[test]
    fn tags_stay_inside_the_folder() {
        assert_eq!(tag_path("images/train"), PathBuf::from("images/train"));
        assert_eq!(tag_path("../x//y z"), PathBuf::from("_/x/_/y_z"));
        assert_eq!(tag_path("/abs"), PathBuf::from("_/abs"));
    }

    #[test]
    fn files_are_copied_whole_under_their_name() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src.bin");
        std::fs::write(&src, b"weights").unwrap();
        let media = MediaFolder::new("test", dir.path().join("media"));
        let rel = media.copy_file("out/model.bin", &src).unwrap();
        assert_eq!(rel, PathBuf::from("files/out/model.bin"));
        assert_eq!(std::fs::read(media.dir().join(&rel)).unwrap(), b"weights");
        let leftovers: Vec<_> = std::fs::read_dir(media.dir().join("files/out"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(leftovers.len(), 1, "{leftovers:?}");
    }
}
