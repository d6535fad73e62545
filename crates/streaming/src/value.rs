//! Decoded samples: a sample is a list of named columns, each a [`Value`]. The types are the
//! union of what MDS encodes (integers, floats, strings, bytes, arrays, raw images, JSON,
//! lists) and what Parquet's row reader gives (the same, plus nulls), kept close to the
//! stored form (an array keeps its bytes and its dtype) so that decoding a column costs one
//! copy.

use std::fmt;

/// The element type of an array, as MDS's `ndarray` encoding names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// `uint8`.
    U8,
    /// `int8`.
    I8,
    /// `uint16`.
    U16,
    /// `int16`.
    I16,
    /// `float16`.
    F16,
    /// `uint32`.
    U32,
    /// `int32`.
    I32,
    /// `float32`.
    F32,
    /// `uint64`.
    U64,
    /// `int64`.
    I64,
    /// `float64`.
    F64,
}

impl DType {
    /// Every dtype, with its numpy name.
    pub const ALL: [(DType, &'static str); 11] = [
        (DType::U8, "uint8"),
        (DType::I8, "int8"),
        (DType::U16, "uint16"),
        (DType::I16, "int16"),
        (DType::F16, "float16"),
        (DType::U32, "uint32"),
        (DType::I32, "int32"),
        (DType::F32, "float32"),
        (DType::U64, "uint64"),
        (DType::I64, "int64"),
        (DType::F64, "float64"),
    ];

    /// The dtype of a numpy name (`"uint8"`).
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.iter().find(|(_, n)| *n == name).map(|(d, _)| *d)
    }

    /// The numpy name.
    pub fn name(self) -> &'static str {
        DType::ALL
            .iter()
            .find(|(d, _)| *d == self)
            .map(|(_, n)| *n)
            .unwrap_or("?")
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::U16 | DType::I16 | DType::F16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }

    /// MDS's one-byte code of the dtype (the `ndarray` encoding's dynamic dtype header).
    pub fn code(self) -> u8 {
        match self {
            DType::U8 => 8,
            DType::I8 => 9,
            DType::U16 => 16,
            DType::I16 => 17,
            DType::F16 => 18,
            DType::U32 => 32,
            DType::I32 => 33,
            DType::F32 => 34,
            DType::U64 => 64,
            DType::I64 => 65,
            DType::F64 => 66,
        }
    }

    /// The dtype of an MDS code.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL
            .iter()
            .map(|(d, _)| *d)
            .find(|d| d.code() == code)
    }
}

/// An n-dimensional array: its dtype, its shape and its elements, little-endian, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct NdArray {
    /// The element type.
    pub dtype: DType,
    /// The shape.
    pub shape: Vec<usize>,
    /// The elements' bytes (little-endian, row-major).
    pub data: Vec<u8>,
}

impl NdArray {
    /// The elements as `f32` (each dtype converted; float16 widened exactly).
    pub fn to_f32(&self) -> Vec<f32> {
        let n = self.dtype.size();
        self.data
            .chunks_exact(n)
            .map(|c| match self.dtype {
                DType::U8 => c[0] as f32,
                DType::I8 => c[0] as i8 as f32,
                DType::U16 => u16::from_le_bytes([c[0], c[1]]) as f32,
                DType::I16 => i16::from_le_bytes([c[0], c[1]]) as f32,
                DType::F16 => f16_to_f32(u16::from_le_bytes([c[0], c[1]])),
                DType::U32 => u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32,
                DType::I32 => i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32,
                DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                DType::U64 => u64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f32,
                DType::I64 => i64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f32,
                DType::F64 => f64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f32,
            })
            .collect()
    }
}

/// IEEE half to single precision (exact).
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let frac = (h & 0x3ff) as u32;
    let bits = match (exp, frac) {
        (0, 0) => sign,
        (0, f) => {
            // Subnormal: normalise.
            let shift = f.leading_zeros() - 21;
            let frac = (f << shift) & 0x3ff;
            sign | ((113 - shift) << 23) | (frac << 13)
        }
        (0x1f, f) => sign | 0x7f80_0000 | (f << 13),
        (e, f) => sign | ((e + 112) << 23) | (f << 13),
    };
    f32::from_bits(bits)
}

/// A raw image as MDS's `pil` encoding stores it: PIL's mode (`"L"`, `"RGB"`, ...), its size
/// and its pixel bytes as PIL's `tobytes` gives them.
#[derive(Debug, Clone, PartialEq)]
pub struct Image {
    /// PIL's mode.
    pub mode: String,
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// The pixels, row-major.
    pub data: Vec<u8>,
}

/// One column's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A missing value (Parquet's null).
    Null,
    /// A boolean (Parquet).
    Bool(bool),
    /// A signed integer.
    Int(i64),
    /// An unsigned integer.
    UInt(u64),
    /// A floating-point number.
    Float(f64),
    /// Text.
    Str(String),
    /// Bytes.
    Bytes(Vec<u8>),
    /// An array.
    Array(NdArray),
    /// A raw image.
    Image(Image),
    /// A JSON value.
    Json(serde_json::Value),
    /// A list of values.
    List(Vec<Value>),
    /// A record of named values (Parquet's groups and maps).
    Struct(Sample),
}

impl Value {
    /// The value's kind, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::UInt(_) => "uint",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::Array(_) => "array",
            Value::Image(_) => "image",
            Value::Json(_) => "json",
            Value::List(_) => "list",
            Value::Struct(_) => "struct",
        }
    }
}

/// One sample: its columns in the dataset's column order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Sample {
    columns: Vec<(String, Value)>,
}

impl Sample {
    /// A sample of `columns`.
    pub fn new(columns: Vec<(String, Value)>) -> Self {
        Sample { columns }
    }

    /// The columns, in order.
    pub fn columns(&self) -> &[(String, Value)] {
        &self.columns
    }

    /// The value of column `name`.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.columns.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    /// Takes column `name` out of the sample.
    pub fn take(&mut self, name: &str) -> Option<Value> {
        let i = self.columns.iter().position(|(n, _)| n == name)?;
        Some(self.columns.swap_remove(i).1)
    }

    fn need(&self, name: &str) -> Result<&Value, String> {
        self.get(name).ok_or_else(|| {
            let names: Vec<&str> = self.columns.iter().map(|(n, _)| n.as_str()).collect();
            format!("no column {name:?} (the sample has {names:?})")
        })
    }

    /// Column `name` as an integer (signed, unsigned, or a whole float).
    pub fn int(&self, name: &str) -> Result<i64, String> {
        match self.need(name)? {
            Value::Int(i) => Ok(*i),
            Value::UInt(u) => {
                i64::try_from(*u).map_err(|_| format!("column {name:?}: {u} is out of range"))
            }
            Value::Float(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(*f as i64),
            v => Err(format!("column {name:?} is {}, not an integer", v.kind())),
        }
    }

    /// Column `name` as bytes: raw bytes, an array's elements, an image's pixels, or text's
    /// UTF-8.
    pub fn bytes(&self, name: &str) -> Result<&[u8], String> {
        match self.need(name)? {
            Value::Bytes(b) => Ok(b),
            Value::Array(a) => Ok(&a.data),
            Value::Image(i) => Ok(&i.data),
            Value::Str(s) => Ok(s.as_bytes()),
            v => Err(format!("column {name:?} is {}, not bytes", v.kind())),
        }
    }

    /// Column `name` as text.
    pub fn str(&self, name: &str) -> Result<&str, String> {
        match self.need(name)? {
            Value::Str(s) => Ok(s),
            v => Err(format!("column {name:?} is {}, not text", v.kind())),
        }
    }
}

impl fmt::Display for Sample {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self
            .columns
            .iter()
            .map(|(n, v)| format!("{n}: {}", v.kind()))
            .collect();
        write!(f, "{{{}}}", names.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_precision_widens_exactly() {
        // Values worked out from IEEE 754 binary16: 1.0, -2.0, 65504 (largest), 2^-24
        // (smallest subnormal), 2^-14 (smallest normal), infinity.
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x0400), 2f32.powi(-14));
        assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24));
        assert!(f16_to_f32(0x7c00).is_infinite());
        assert!(f16_to_f32(0x7e00).is_nan());
    }

    #[test]
    fn dtype_codes_round_trip() {
        for (d, name) in DType::ALL {
            assert_eq!(DType::from_code(d.code()), Some(d));
            assert_eq!(DType::from_name(name), Some(d));
        }
    }
}
