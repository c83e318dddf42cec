//! [`Text`]: immutable text shared by reference count.
//!
//! The texts of channel records and chat messages are `Text`: a turn hands its channel's history
//! to the model without copying a byte of it (out of the memory store, into the request of every
//! model round), because a clone is a reference count.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Immutable text; a clone shares it (a reference count), it is never copied.
///
/// It reads like a `&str` (it derefs to `str`), compares with `str`, `&str` and `String`, and
/// is made from either with `.into()`; it serializes as a plain string.
///
/// ```
/// use spacebot_core::Text;
/// let t: Text = "hello".into();
/// let u = t.clone(); // shares the text
/// assert_eq!(u, "hello");
/// assert!(t.starts_with("he"));
/// assert_eq!(t.as_str(), "hello");
/// assert_eq!(String::from(t), "hello");
/// ```
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Text(Arc<str>);

impl Text {
    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The text as an owned `String` (a copy).
    pub fn into_string(self) -> String {
        String::from(&*self.0)
    }
}

impl Default for Text {
    fn default() -> Self {
        Self(Arc::from(""))
    }
}

impl Deref for Text {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Text {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for Text {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl From<String> for Text {
    fn from(s: String) -> Self {
        Self(Arc::from(s))
    }
}

impl From<&String> for Text {
    fn from(s: &String) -> Self {
        Self(Arc::from(s.as_str()))
    }
}

impl From<&str> for Text {
    fn from(s: &str) -> Self {
        Self(Arc::from(s))
    }
}

impl From<&Text> for Text {
    fn from(s: &Text) -> Self {
        s.clone()
    }
}

impl From<Arc<str>> for Text {
    fn from(s: Arc<str>) -> Self {
        Self(s)
    }
}

impl From<std::borrow::Cow<'_, str>> for Text {
    fn from(s: std::borrow::Cow<'_, str>) -> Self {
        Self(Arc::from(s))
    }
}

impl From<Text> for String {
    fn from(t: Text) -> Self {
        t.into_string()
    }
}

impl From<Text> for Arc<str> {
    fn from(t: Text) -> Self {
        t.0
    }
}

impl PartialEq<str> for Text {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for Text {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl PartialEq<String> for Text {
    fn eq(&self, other: &String) -> bool {
        &*self.0 == other.as_str()
    }
}

impl PartialEq<Text> for str {
    fn eq(&self, other: &Text) -> bool {
        self == &*other.0
    }
}

impl PartialEq<Text> for &str {
    fn eq(&self, other: &Text) -> bool {
        *self == &*other.0
    }
}

impl PartialEq<Text> for String {
    fn eq(&self, other: &Text) -> bool {
        self.as_str() == &*other.0
    }
}

impl Serialize for Text {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(Self(<Arc<str>>::deserialize(deserializer)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_and_serialize_as_strings() {
        let t = Text::from(String::from("abc"));
        let u = t.clone();
        assert!(std::ptr::eq(t.as_str(), u.as_str()));
        assert_eq!(serde_json::to_string(&t).unwrap(), "\"abc\"");
        let back: Text = serde_json::from_str("\"abc\"").unwrap();
        assert_eq!(back, t);
        assert_eq!(Text::default(), "");
        assert_eq!("abc", t);
        assert_eq!(String::from("abc"), t);
    }
}
