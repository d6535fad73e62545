//! [`ImageVisualizer`] (Composer's `ImageVisualizer`): every `interval`, a grid of the training
//! batch's first images as the model saw them, after the algorithms that change inputs (MixUp,
//! CutMix, CutOut, RandAugment...) did their work, each labelled with the model's prediction
//! and the true class, logged as an image (TensorBoard's Images tab, MLflow artifacts, the file
//! loggers' `media/` folder) and as text (`<tag>/labels`).
//!
//! Each cell is one image scaled to 0-255 by its own minimum and maximum (inputs are usually
//! normalised; a constant image is mid-grey), enlarged by a whole factor to at least 56 pixels,
//! above a strip `p<predicted> t<true>` in green when they agree and red when not. A batch with
//! soft targets (MixUp, CutMix) shows its largest class, and the second one when it holds at
//! least a tenth of the target, as `t<a>+<b>`. The digits are
//! drawn from a 3x5 pixel font kept here, since a fresh machine may have no font files and the
//! labels are digits only.
//!
//! The grid is taken at `AFTER_LOSS` (the batch as trained on, with the outputs) of the first
//! microbatch of a batch due, and logged at that batch's `BATCH_END`, at the same step as its
//! loss. Only the main process logs.

use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Tensor};
use flashover_core::callback::{Callback, Control};
use flashover_core::collective::Ranks;
use flashover_core::error::{CoreError, Result};
use flashover_core::logger::Image;
use flashover_core::model::{ClassTargets, ImageBatch, Logits};
use flashover_core::setup::{BatchOf, OutputOf, Setup};
use flashover_core::state::State;
use flashover_core::time::Time;

use crate::error::CallbackError;
use crate::monitors::{batch_interval, due};

/// The image visualizer; see the module docs.
#[derive(Debug, Clone)]
pub struct ImageVisualizer {
    every: Time,
    num_images: usize,
    columns: usize,
    tag: String,
    /// The grid taken at `AFTER_LOSS`, waiting for its batch's `BATCH_END`.
    pending: Option<(u64, Image, String)>,
}

impl ImageVisualizer {
    /// Logs a grid of the first 8 images of the training batch every `every` (batches or
    /// epochs), under the tag `inputs/train`.
    pub fn new(every: Time) -> crate::error::Result<Self> {
        Ok(ImageVisualizer {
            every: batch_interval("image_visualizer", every)?,
            num_images: 8,
            columns: 8,
            tag: "inputs/train".into(),
            pending: None,
        })
    }

    /// How many images of the batch to show (at least 1; fewer if the batch is smaller), in
    /// rows of `columns` (at least 1).
    pub fn with_images(mut self, num_images: usize, columns: usize) -> crate::error::Result<Self> {
        if num_images == 0 || columns == 0 {
            return Err(CallbackError::param(
                "image_visualizer",
                "num_images, columns",
                format!("{num_images}, {columns}"),
                "at least one image in rows of at least one",
            ));
        }
        self.num_images = num_images;
        self.columns = columns;
        Ok(self)
    }

    /// The tag the grid is logged under (default `inputs/train`).
    pub fn with_tag(mut self, tag: impl Into<String>) -> Self {
        self.tag = tag.into();
        self
    }
}

impl<S: Setup> Callback<S> for ImageVisualizer
where
    BatchOf<S>: ImageBatch<S::Backend> + ClassTargets<S::Backend>,
    OutputOf<S>: Logits<S::Backend>,
{
    fn name(&self) -> &str {
        "image_visualizer"
    }

    fn ranks(&self) -> Ranks {
        Ranks::Main
    }

    fn after_loss(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        let ts = state.timestamp();
        let batch_number = ts.batch + 1;
        let is_due = due(
            self.every,
            batch_number,
            ts.epoch,
            ts.batch_in_epoch + 1,
            state.batches_per_epoch(),
        );
        if !is_due || self.pending.as_ref().is_some_and(|p| p.0 == batch_number) {
            return Ok(());
        }
        let (Some(batch), Some(outputs)) = (state.batch(), state.outputs()) else {
            return Ok(());
        };
        let cells = cells::<S::Backend>(
            batch.images(),
            batch.classes(),
            batch.soft_targets(),
            outputs.logits(),
            self.num_images,
        )?;
        let caption = cells
            .iter()
            .map(|c| format!("{}/{}", c.predicted, c.truth))
            .collect::<Vec<_>>()
            .join(" ");
        let image = grid(&cells, self.columns)?;
        self.pending = Some((
            batch_number,
            image,
            format!("predicted/true, left to right, top to bottom: {caption}"),
        ));
        Ok(())
    }

    fn batch_end(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
        let ts = state.timestamp();
        if let Some((batch, image, caption)) = self.pending.take() {
            if batch == ts.batch {
                ctl.logger().log_image(ts, &self.tag, &image)?;
                ctl.logger()
                    .log_text(ts, &format!("{}/labels", self.tag), &caption)?;
            }
        }
        Ok(())
    }
}

/// One image of the grid: its pixels (channels, height, width; 1 or 3 channels) and labels.
#[derive(Debug, Clone)]
pub struct Cell {
    /// Pixels scaled to 0-255, `[channels][height][width]`.
    pub pixels: Vec<u8>,
    /// 1 (grey) or 3 (RGB).
    pub channels: usize,
    /// Height in pixels.
    pub height: usize,
    /// Width in pixels.
    pub width: usize,
    /// The model's class (the largest logit).
    pub predicted: String,
    /// The true class, or the soft target's two largest (`a+b`).
    pub truth: String,
    /// Whether the prediction is the (first) true class.
    pub correct: bool,
}

fn floats<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .iter::<B::FloatElem>()
        .map(|x| x.elem::<f32>())
        .collect()
}

/// The first `n` images of a batch with their labels.
fn cells<B: Backend>(
    images: &Tensor<B, 4>,
    classes: &Tensor<B, 1, burn::tensor::Int>,
    soft: Option<&Tensor<B, 2>>,
    logits: &Tensor<B, 2>,
    n: usize,
) -> Result<Vec<Cell>> {
    let [batch, channels, height, width] = images.dims();
    let n = n.min(batch);
    if n == 0 {
        return Ok(Vec::new());
    }
    let pixels = floats(images.clone().narrow(0, 0, n));
    let classes: Vec<i64> = classes
        .clone()
        .narrow(0, 0, n)
        .into_data()
        .iter::<B::IntElem>()
        .map(|x| x.elem::<i64>())
        .collect();
    let [rows, num_classes] = logits.dims();
    if rows < n {
        return Err(CoreError::External {
            component: "image_visualizer".into(),
            source: format!("{rows} rows of logits for a batch of {batch} images").into(),
        });
    }
    let logits = floats(logits.clone().narrow(0, 0, n));
    let soft = soft.map(|s| floats(s.clone().narrow(0, 0, n)));
    let shown = if channels == 3 { 3 } else { 1 };
    let plane = height * width;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let image = &pixels[i * channels * plane..(i + 1) * channels * plane];
        let image = &image[..shown * plane];
        let (lo, hi) = image
            .iter()
            .filter(|v| v.is_finite())
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            });
        let scaled = image
            .iter()
            .map(|&v| {
                if hi <= lo || !hi.is_finite() || !v.is_finite() {
                    128
                } else {
                    ((v - lo) / (hi - lo) * 255.0).round().clamp(0.0, 255.0) as u8
                }
            })
            .collect();
        let row = &logits[i * num_classes..(i + 1) * num_classes];
        let predicted = argmax(row);
        let (truth, first) = match &soft {
            Some(soft) => {
                let row = &soft[i * num_classes..(i + 1) * num_classes];
                let a = argmax(row);
                let mut rest = row.to_vec();
                rest[a] = f32::NEG_INFINITY;
                let b = argmax(&rest);
                // The second class counts when it holds a tenth of the target or more (MixUp's
                // and CutMix's mixed-in class; not label smoothing's spread).
                if b != a && row[b] >= 0.1 {
                    (format!("{a}+{b}"), a)
                } else {
                    (a.to_string(), a)
                }
            }
            None => (classes[i].to_string(), classes[i].max(0) as usize),
        };
        out.push(Cell {
            pixels: scaled,
            channels: shown,
            height,
            width,
            predicted: predicted.to_string(),
            truth,
            correct: predicted == first,
        });
    }
    Ok(out)
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv {
                (i, v)
            } else {
                (bi, bv)
            }
        })
        .0
}

/// The 3x5 glyphs the labels use: five rows of three bits, the top row first.
fn glyph(c: char) -> [u8; 5] {
    match c {
        '0' => [0b111, 0b101, 0b101, 0b101, 0b111],
        '1' => [0b010, 0b110, 0b010, 0b010, 0b111],
        '2' => [0b111, 0b001, 0b111, 0b100, 0b111],
        '3' => [0b111, 0b001, 0b111, 0b001, 0b111],
        '4' => [0b101, 0b101, 0b111, 0b001, 0b001],
        '5' => [0b111, 0b100, 0b111, 0b001, 0b111],
        '6' => [0b111, 0b100, 0b111, 0b101, 0b111],
        '7' => [0b111, 0b001, 0b010, 0b010, 0b010],
        '8' => [0b111, 0b101, 0b111, 0b101, 0b111],
        '9' => [0b111, 0b101, 0b111, 0b001, 0b111],
        'p' => [0b110, 0b101, 0b110, 0b100, 0b100],
        't' => [0b010, 0b111, 0b010, 0b010, 0b011],
        '+' => [0b000, 0b010, 0b111, 0b010, 0b000],
        ' ' => [0; 5],
        _ => [0b111, 0b001, 0b010, 0b000, 0b010],
    }
}

/// Pixels a glyph's pixel becomes, and the gaps of the label strip.
const FONT_SCALE: usize = 2;
const PAD: usize = 2;
const STRIP: usize = 5 * FONT_SCALE + 2 * PAD;

/// An RGB canvas.
struct Canvas {
    width: usize,
    height: usize,
    rgb: Vec<u8>,
}

impl Canvas {
    fn put(&mut self, x: usize, y: usize, color: [u8; 3]) {
        if x < self.width && y < self.height {
            let i = (y * self.width + x) * 3;
            self.rgb[i..i + 3].copy_from_slice(&color);
        }
    }

    fn text(&mut self, x: usize, y: usize, text: &str, color: [u8; 3]) {
        for (k, c) in text.chars().enumerate() {
            let g = glyph(c);
            let x0 = x + k * 4 * FONT_SCALE;
            for (row, bits) in g.iter().enumerate() {
                for col in 0..3 {
                    if bits >> (2 - col) & 1 == 1 {
                        for dy in 0..FONT_SCALE {
                            for dx in 0..FONT_SCALE {
                                self.put(
                                    x0 + col * FONT_SCALE + dx,
                                    y + row * FONT_SCALE + dy,
                                    color,
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The labelled grid of `cells`, `columns` to a row, as an RGB image.
pub fn grid(cells: &[Cell], columns: usize) -> Result<Image> {
    let Some(first) = cells.first() else {
        return Image::new(1, 1, 3, vec![0; 3]);
    };
    let (h, w) = (first.height, first.width);
    let zoom = (56 / h.max(w).max(1)).max(1);
    let label_width = |c: &Cell| (format!("p{} t{}", c.predicted, c.truth).len()) * 4 * FONT_SCALE;
    let cell_w = (w * zoom).max(cells.iter().map(label_width).max().unwrap_or(0)) + 2 * PAD;
    let cell_h = h * zoom + STRIP + PAD;
    let columns = columns.min(cells.len());
    let rows = cells.len().div_ceil(columns);
    let mut canvas = Canvas {
        width: columns * cell_w + PAD,
        height: rows * cell_h + PAD,
        rgb: vec![0; (columns * cell_w + PAD) * (rows * cell_h + PAD) * 3],
    };
    for (i, cell) in cells.iter().enumerate() {
        let (x0, y0) = (PAD + (i % columns) * cell_w, PAD + (i / columns) * cell_h);
        let plane = h * w;
        for y in 0..h * zoom {
            for x in 0..w * zoom {
                let at = (y / zoom) * w + x / zoom;
                let color = if cell.channels == 3 {
                    [
                        cell.pixels[at],
                        cell.pixels[plane + at],
                        cell.pixels[2 * plane + at],
                    ]
                } else {
                    [cell.pixels[at]; 3]
                };
                canvas.put(x0 + x, y0 + y, color);
            }
        }
        let color = if cell.correct {
            [40, 200, 60]
        } else {
            [235, 50, 50]
        };
        canvas.text(
            x0,
            y0 + h * zoom + PAD,
            &format!("p{} t{}", cell.predicted, cell.truth),
            color,
        );
    }
    Image::new(canvas.width as u32, canvas.height as u32, 3, canvas.rgb)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::{Int, TensorData};

    type B = Flex;

    #[test]
    fn cells_scale_each_image_and_read_the_labels() {
        let device = Default::default();
        // Two 1x2x2 images: [0, 1, 2, 3] and a constant one.
        let images = Tensor::<B, 4>::from_data(
            TensorData::new(
                vec![0.0f32, 1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 5.0],
                [2, 1, 2, 2],
            ),
            &device,
        );
        let classes = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![1i64, 0], [2]), &device);
        let logits = Tensor::<B, 2>::from_data(
            TensorData::new(vec![0.1f32, 0.9, 0.3, 0.2], [2, 2]),
            &device,
        );
        let c = cells::<B>(&images, &classes, None, &logits, 8).unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].pixels, [0, 85, 170, 255]);
        assert_eq!(c[1].pixels, [128; 4]);
        assert_eq!(
            (c[0].predicted.as_str(), c[0].truth.as_str(), c[0].correct),
            ("1", "1", true)
        );
        assert_eq!(
            (c[1].predicted.as_str(), c[1].truth.as_str(), c[1].correct),
            ("0", "0", true)
        );
        // Soft targets: the two largest classes.
        let soft = Tensor::<B, 2>::from_data(
            TensorData::new(vec![0.3f32, 0.7, 1.0, 0.0], [2, 2]),
            &device,
        );
        let c = cells::<B>(&images, &classes, Some(&soft), &logits, 1).unwrap();
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].truth, "1+0");
    }

    #[test]
    fn the_grid_holds_each_image_enlarged_with_its_label() {
        let cell = |v: u8, predicted: &str, truth: &str| Cell {
            pixels: vec![v; 4],
            channels: 1,
            height: 2,
            width: 2,
            predicted: predicted.into(),
            truth: truth.into(),
            correct: predicted == truth,
        };
        let cells = [cell(10, "3", "3"), cell(200, "4", "7"), cell(90, "1", "1")];
        let image = grid(&cells, 2).unwrap();
        let zoom = 28; // 56 / 2
        let label = "p4 t7".len() * 4 * FONT_SCALE;
        let cell_w = (2 * zoom).max(label) + 2 * PAD;
        let cell_h = 2 * zoom + STRIP + PAD;
        assert_eq!(image.width() as usize, 2 * cell_w + PAD);
        assert_eq!(image.height() as usize, 2 * cell_h + PAD);
        let px = |x: usize, y: usize| {
            let i = (y * image.width() as usize + x) * 3;
            [
                image.pixels()[i],
                image.pixels()[i + 1],
                image.pixels()[i + 2],
            ]
        };
        // Every pixel of each enlarged image has its value.
        for (k, v) in [(0usize, 10u8), (1, 200), (2, 90)] {
            let (x0, y0) = (PAD + (k % 2) * cell_w, PAD + (k / 2) * cell_h);
            for y in 0..2 * zoom {
                for x in 0..2 * zoom {
                    assert_eq!(px(x0 + x, y0 + y), [v; 3]);
                }
            }
        }
        // The labels: green for a right prediction, red for a wrong one; the strip holds
        // only those colours and black.
        let strip = |k: usize| {
            let (x0, y0) = (PAD + (k % 2) * cell_w, PAD + (k / 2) * cell_h + 2 * zoom);
            let mut colours = std::collections::BTreeSet::new();
            for y in y0..y0 + STRIP {
                for x in x0..x0 + cell_w - PAD {
                    colours.insert(px(x, y));
                }
            }
            colours
        };
        assert_eq!(strip(0), [[0, 0, 0], [40, 200, 60]].into_iter().collect());
        assert_eq!(strip(1), [[0, 0, 0], [235, 50, 50]].into_iter().collect());
    }

    #[test]
    fn glyphs_differ_for_every_digit() {
        let all: std::collections::BTreeSet<[u8; 5]> = "0123456789pt+".chars().map(glyph).collect();
        assert_eq!(all.len(), 13);
    }

    #[test]
    fn a_bad_interval_or_count_is_refused_by_name() {
        let e = ImageVisualizer::new(Time::Sample(3))
            .unwrap_err()
            .to_string();
        assert!(e.contains("interval"), "{e}");
        let e = ImageVisualizer::new(Time::Batch(1))
            .unwrap()
            .with_images(0, 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_images"), "{e}");
    }
}
