//! The config file (`--config`): one flat `version: v1` map whose keys are the file keys of every
//! settings struct of [`super`], each optional; an unknown key is an error.
//!
//! Each key goes to the struct that declares it, and that struct's own derived `Deserialize`
//! reads the value straight from the file's deserializer, so a bad value keeps its key path,
//! line and column. Which struct declares a key is asked of the derive itself ([`keys_of`]), so
//! a field added to a settings struct is a file key without being listed anywhere else.
//!
//! Why not `#[serde(flatten)]` into one struct: serde does not combine it with
//! `deny_unknown_fields`, and it buffers the map before the inner structs see it, so their
//! errors lose line, column and the key path. Why not one file section per struct: the file
//! format is a contract, and it is flat.

use std::marker::PhantomData;
use std::path::Path;
use std::sync::OnceLock;

use serde::de::{self, DeserializeOwned, DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, forward_to_deserialize_any};

use super::{FILE_VERSION, Result, Section, Settings, invalid};

/// The optional config file: its version and the settings it gives.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct FileConfig {
    pub version: String,
    pub settings: Settings,
}

impl FileConfig {
    pub fn load(path: &Path) -> Result<Self> {
        let key = format!("--config {}", path.display());
        let text = std::fs::read_to_string(path)
            .map_err(|e| invalid(&key, format!("cannot read the config file: {e}")))?;
        let file: FileConfig = crate::yaml::from_str(&text)
            .map_err(|e| invalid(&format!("{}: {}", path.display(), e.path), e.to_string()))?;
        if file.version != FILE_VERSION {
            return Err(invalid(
                &format!("{}: version", path.display()),
                format!(
                    "unsupported config version {:?}; this nvdra reads {FILE_VERSION:?}",
                    file.version
                ),
            ));
        }
        // Alternatives (see `Section::under`) are checked where each level is read: clap's
        // `conflicts_with` for the command line, here for the file.
        let s = &file.settings;
        for (both, keys, what) in [
            (
                s.backend.profile.is_some() && s.backend.topology.is_some(),
                "profile/topology",
                "a built-in profile or a topology file",
            ),
            (
                s.api.api_dir.is_some() && s.api.cluster.kubeconfig.is_some(),
                "apiDir/kubeconfig",
                "an API directory or a kubeconfig",
            ),
        ] {
            if both {
                return Err(invalid(
                    &format!("{}: {keys}", path.display()),
                    format!("the config file sets both; keep one: {what}"),
                ));
            }
        }
        Ok(file)
    }
}

/// Every key a config file may have.
pub(super) fn file_keys() -> &'static [&'static str] {
    static KEYS: OnceLock<Vec<&'static str>> = OnceLock::new();
    KEYS.get_or_init(|| {
        let mut keys = vec!["version"];
        for section in Settings::section_keys() {
            keys.extend_from_slice(section);
        }
        keys
    })
}

/// Reads the value of `key` into `slot` if `key` is one of `T`'s file keys; false if it is not.
pub(super) fn read_into<'de, T: Section, A: MapAccess<'de>>(
    slot: &mut T,
    key: &str,
    map: &mut A,
) -> Result<bool, A::Error> {
    if !keys_of::<T>().contains(&key) {
        return Ok(false);
    }
    let value: T = map.next_value_seed(OneKey {
        key,
        of: PhantomData,
    })?;
    // Keys come once, so this only adds the one setting `value` has.
    *slot = value.or(std::mem::take(slot));
    Ok(true)
}

impl<'de> Deserialize<'de> for FileConfig {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        de.deserialize_struct("FileConfig", file_keys(), FileVisitor)
    }
}

struct FileVisitor;

impl<'de> Visitor<'de> for FileVisitor {
    type Value = FileConfig;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an nvdra config file (a map of settings)")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<FileConfig, A::Error> {
        let mut version = None;
        let mut settings = Settings::default();
        // The YAML parser refuses a duplicate key, so each key comes once.
        while let Some(key) = map.next_key::<String>()? {
            if key == "version" {
                version = Some(map.next_value::<String>()?);
            } else if !settings.read_entry(&key, &mut map)? {
                return Err(de::Error::unknown_field(&key, file_keys()));
            }
        }
        let version = version.ok_or_else(|| de::Error::missing_field("version"))?;
        Ok(FileConfig { version, settings })
    }
}

/// The keys `T`'s derived `Deserialize` accepts. Serde's derive hands a struct's field names
/// (renamed, skipped ones left out) to `deserialize_struct`; [`FieldNames`] keeps them and stops.
pub(super) fn keys_of<T: DeserializeOwned>() -> &'static [&'static str] {
    let mut keys: &'static [&'static str] = &[];
    // Always an error: `FieldNames` never produces a value.
    let _ = T::deserialize(FieldNames(&mut keys));
    keys
}

struct FieldNames<'a>(&'a mut &'static [&'static str]);

impl<'de> Deserializer<'de> for FieldNames<'_> {
    type Error = de::value::Error;

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Self::Error> {
        *self.0 = fields;
        Err(de::Error::custom("field names recorded"))
    }

    fn deserialize_any<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, Self::Error> {
        Err(de::Error::custom("not a struct with named fields"))
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// Deserializes a `T` from the one entry `key: <value>`, the value read by the file's own
/// deserializer.
struct OneKey<'k, T> {
    key: &'k str,
    of: PhantomData<T>,
}

impl<'de, T: Deserialize<'de>> DeserializeSeed<'de> for OneKey<'_, T> {
    type Value = T;

    fn deserialize<D: Deserializer<'de>>(self, value: D) -> Result<T, D::Error> {
        T::deserialize(OneEntry {
            key: Some(self.key),
            value: Some(value),
        })
    }
}

/// A map of one entry, as a deserializer and as its own `MapAccess`.
struct OneEntry<'k, D> {
    key: Option<&'k str>,
    value: Option<D>,
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for OneEntry<'_, D> {
    type Error = D::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        visitor.visit_map(self)
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map struct enum
        identifier ignored_any
    }
}

impl<'de, D: Deserializer<'de>> MapAccess<'de> for OneEntry<'_, D> {
    type Error = D::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, D::Error> {
        self.key
            .take()
            .map(|k| seed.deserialize(de::value::StrDeserializer::<D::Error>::new(k)))
            .transpose()
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, D::Error> {
        match self.value.take() {
            Some(value) => seed.deserialize(value),
            None => Err(de::Error::custom("a map entry's value was read twice")),
        }
    }
}
