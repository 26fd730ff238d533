//! What of a request body goes into the cache key, and how a stored answer gets the
//! requester's id back.
//!
//! KServe v2 requests carry an optional request id (REST: top-level JSON `"id"`; gRPC:
//! `ModelInferRequest.id`, field 3) that the server echoes in its answer. Clients set a fresh one
//! per call, so the key leaves it out; the answer is stored with its echoed id removed, and a
//! hit puts the requester's id back exactly where, and exactly as, the server wrote it.
//!
//! REST ids are spliced only when every JSON encoder writes them the same way ("plain" ids, see
//! `is_plain_rest_id`; UUIDs and the like). Other ids (escapes, non-ASCII, empty, very long) stay
//! in the key: the answer is cached per id and replayed verbatim, which is still exact.

use crate::grpc::{Fields, Value};
use std::borrow::Cow;
use crate::json::{self, Member};

/// Longer ids stay in the key (and a gRPC hit's marker stays small).
pub const MAX_SPLICED_ID_BYTES: usize = 256;

use crate::names::Bypass;

/// The request id as far as the key and the answer are concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestId {
    /// No id (gRPC: also the empty id, which proto3 does not distinguish).
    None,
    /// Left out of the key; the answer is stored without it and hits get theirs put back.
    Spliced(Vec<u8>),
    /// Kept in the key (an id the filter cannot re-encode exactly): answers replay verbatim.
    Kept,
}

impl RequestId {
    fn tag(&self) -> u8 {
        match self {
            RequestId::None => 0,
            RequestId::Spliced(_) => 1,
            RequestId::Kept => 2,
        }
    }
}

/// The keyed form of a body: slices of the original, in order, with the left-out parts gone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyedBytes<'a> {
    pub parts: Vec<&'a [u8]>,
    /// With the binary tensor extension: the kept JSON part's length (where binary data starts).
    pub json_len: Option<u64>,
    pub id: RequestId,
}

impl<'a> KeyedBytes<'a> {
    pub fn whole(body: &'a [u8]) -> KeyedBytes<'a> {
        KeyedBytes { parts: vec![body], json_len: None, id: RequestId::None }
    }
    /// Separates keys of different id handling, so an answer stored without an id never
    /// serves a request that had one (and the reverse).
    pub fn form_tag(&self) -> u8 {
        self.id.tag()
    }
}

/// What a JSON body's key leaves out and checks, from the matched policy.
#[derive(Clone, Copy, Debug, Default)]
pub struct JsonRules<'p> {
    /// The KServe v2 request id (REST inference paths only).
    pub request_id: bool,
    /// Top-level fields left out of the key.
    pub ignore_fields: &'p [String],
    /// Bypass sampled answers: `temperature` > 0 (absent means the OpenAI default, 1) without
    /// `seed`; several choices (`n` other than 1); tools offered (`tools`, `functions`).
    pub deterministic_only: bool,
}

/// A REST ids is spliced only if every JSON encoder writes it byte for byte the same
/// (Python's json with ensure_ascii, rapidjson, Go's HTML-safe encoding, serde...).
pub fn is_plain_rest_id(id: &[u8]) -> bool {
    !id.is_empty()
        && id.len() <= MAX_SPLICED_ID_BYTES
        && id.iter().all(|b| b.is_ascii_alphanumeric() || b"-_.:~+=@".contains(b))
}

/// The JSON part and the binary part of a REST body (binary tensor extension). `values`: every
/// line of `inference-header-content-length`. Only one plain decimal (ASCII digits, at most 19)
/// no larger than the body is read; servers read anything else their own way (a sign, spaces,
/// other digits, the first or the last of repeated lines) or reject it, so it bypasses.
pub fn split_binary(body: &[u8], values: &[&str]) -> Result<(usize, bool), Bypass> {
    match values {
        [] => Ok((body.len(), false)),
        [v] => match plain_decimal(v) {
            Some(n) if n <= body.len() as u64 => Ok((n as usize, true)),
            _ => Err(Bypass::BinaryLength),
        },
        _ => Err(Bypass::BinaryLength),
    }
}

/// `[0-9]{1,19}` as a number (19 digits always fit a u64), else None.
pub fn plain_decimal(v: &str) -> Option<u64> {
    if v.is_empty() || v.len() > 19 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse().ok()
}

/// llama.cpp's "pick a random seed" value (`LLAMA_DEFAULT_SEED`, -1 as a u32).
const RANDOM_SEED_SENTINEL: &[u8] = b"4294967295";

/// A `seed` that fixes the sampler: a JSON integer token without a sign, fraction or exponent
/// (`[0-9]+`). A negative seed (llama.cpp-style servers read -1 as "pick a random seed") and
/// llama.cpp's random-seed sentinel do not.
fn is_fixed_seed(raw: &[u8]) -> bool {
    !raw.is_empty() && raw.iter().all(u8::is_ascii_digit) && raw != RANDOM_SEED_SENTINEL
}

/// `[]`, with any JSON whitespace inside.
fn is_empty_array(raw: &[u8]) -> bool {
    let inner: Vec<u8> = raw.iter().copied().filter(|b| !b" \t\r\n".contains(b)).collect();
    inner == b"[]"
}

/// The key body of a JSON request under `rules`, with the top-level members already scanned
/// (the caller may have read the model from them).
pub fn shape_json<'a>(
    body: &'a [u8],
    json_len: usize,
    binary: bool,
    members: &[Member],
    rules: &JsonRules,
) -> Result<KeyedBytes<'a>, Bypass> {
    let json = &body[..json_len];
    let mut drop = vec![false; members.len()];
    let mut id = RequestId::None;
    let mut seen_id = false;
    let mut temperature: Option<&[u8]> = None;
    let mut seeded = false;
    let mut seen_seed = false;
    let mut seen_n = false;
    let mut several = false;
    let mut seen_tools = [false, false];
    let mut tools = false;
    for (i, m) in members.iter().enumerate() {
        if rules.ignore_fields.iter().any(|f| m.key_is(json, f)) {
            drop[i] = true;
            continue;
        }
        if rules.request_id && m.key_is(json, "id") {
            if seen_id {
                // Parsers disagree on duplicates (first or last wins): not keyable.
                return Err(Bypass::Unparsable);
            }
            seen_id = true;
            let raw = m.value_raw(json);
            if raw.first() != Some(&b'"') {
                // KServe ids are strings; what a server does with another type is its own.
                return Err(Bypass::Unparsable);
            }
            let decoded = json::decode_string(raw).ok_or(Bypass::Unparsable)?;
            if is_plain_rest_id(decoded.as_bytes()) {
                drop[i] = true;
                id = RequestId::Spliced(decoded.into_bytes());
            } else {
                id = RequestId::Kept;
            }
            continue;
        }
        if rules.deterministic_only {
            if m.key_is(json, "temperature") {
                if temperature.is_some() {
                    return Err(Bypass::Unparsable);
                }
                temperature = Some(m.value_raw(json));
            } else if m.key_is(json, "seed") {
                if seen_seed {
                    return Err(Bypass::Unparsable);
                }
                seen_seed = true;
                // Only a non-negative integer fixes the sampler (false, "x", {}, 1.5, -1 do not).
                seeded = is_fixed_seed(m.value_raw(json));
            } else if m.key_is(json, "n") {
                if seen_n {
                    return Err(Bypass::Unparsable);
                }
                seen_n = true;
                // Absent, null and 1 are one choice; anything else (2, "2", 1.5) is not one.
                several = !matches!(m.value_raw(json), b"null" | b"1");
            } else if let Some(t) = ["tools", "functions"].iter().position(|f| m.key_is(json, f)) {
                if seen_tools[t] {
                    return Err(Bypass::Unparsable);
                }
                seen_tools[t] = true;
                // Only null or an empty list offers nothing.
                let raw = m.value_raw(json);
                if raw != b"null" && !is_empty_array(raw) {
                    tools = true;
                }
            }
        }
    }
    if several {
        return Err(Bypass::MultipleChoices);
    }
    if tools {
        return Err(Bypass::ToolCalls);
    }
    if rules.deterministic_only && !seeded {
        let sampled = match temperature {
            None | Some(b"null") => true,
            Some(raw) => match std::str::from_utf8(raw).ok().and_then(|t| t.parse::<f64>().ok()) {
                Some(t) => t > 0.0,
                None => return Err(Bypass::Unparsable),
            },
        };
        if sampled {
            return Err(Bypass::Nondeterministic);
        }
    }
    let mut parts = json::without_members(json, members, &drop);
    let kept_json: usize = parts.iter().map(|p| p.len()).sum();
    if binary && json_len < body.len() {
        parts.push(&body[json_len..]);
    }
    Ok(KeyedBytes { parts, json_len: if binary { Some(kept_json as u64) } else { None }, id })
}

/// A gRPC ModelInferRequest read for the key: the model, and the body without the id.
#[derive(Debug, PartialEq)]
pub struct GrpcRequest<'a> {
    pub model_name: String,
    pub model_version: String,
    pub key: KeyedBytes<'a>,
}

/// Parses the (unframed) ModelInferRequest's top level: fields 1/2 (model) and 3 (id). The last
/// of repeated scalar fields wins, as in every protobuf parser; a known field with the wrong wire
/// type, invalid UTF-8 or a malformed message is unparsable.
pub fn grpc_request(message: &[u8]) -> Result<GrpcRequest<'_>, Bypass> {
    let mut name: &[u8] = b"";
    let mut version: &[u8] = b"";
    let mut id: &[u8] = b"";
    let mut id_spans: Vec<(usize, usize)> = Vec::new();
    let mut fields = Fields::new(message);
    loop {
        let start = message.len() - fields.remaining();
        let field = match fields.next() {
            None => break,
            Some(Ok(f)) => f,
            Some(Err(())) => return Err(Bypass::Unparsable),
        };
        let end = message.len() - fields.remaining();
        match field {
            (1, Value::Bytes(b)) => name = b,
            (2, Value::Bytes(b)) => version = b,
            (3, Value::Bytes(b)) => {
                id = b;
                id_spans.push((start, end));
            }
            (1..=3, _) => return Err(Bypass::Unparsable),
            _ => {}
        }
    }
    let text = |b: &[u8]| std::str::from_utf8(b).map(str::to_string).map_err(|_| Bypass::Unparsable);
    let (model_name, model_version) = (text(name)?, text(version)?);
    text(id)?;
    let mut parts = Vec::with_capacity(id_spans.len() + 1);
    let mut at = 0;
    for (s, e) in &id_spans {
        if *s > at {
            parts.push(&message[at..*s]);
        }
        at = *e;
    }
    if at < message.len() || parts.is_empty() {
        parts.push(&message[at..]);
    }
    let id = if id.is_empty() {
        RequestId::None
    } else if id.len() <= MAX_SPLICED_ID_BYTES {
        RequestId::Spliced(id.to_vec())
    } else {
        // Kept in the key: the id fields go back in.
        return Ok(GrpcRequest { model_name, model_version, key: KeyedBytes { parts: vec![message], json_len: None, id: RequestId::Kept } });
    };
    Ok(GrpcRequest { model_name, model_version, key: KeyedBytes { parts, json_len: None, id } })
}

/// Where a stored answer's id was, so a hit can put the requester's id back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Splice {
    /// JSON: insert `before` + id + `after` at `at` (the bytes the server wrote around the id,
    /// e.g. `"id":"` and `",`). `json_len_header`: the answer's `inference-header-content-length`
    /// counts the JSON part, and grows by what is inserted.
    Json { at: u32, before: Vec<u8>, after: Vec<u8>, json_len_header: bool },
    /// Protobuf: insert field 3 (tag, length, id) at `at`.
    Proto { at: u32 },
}

/// The stored form of an answer: without its id, and where the id goes back.
#[derive(Debug, PartialEq)]
pub struct Stripped {
    pub body: Vec<u8>,
    pub splice: Option<Splice>,
}

/// Removes the echoed id from a JSON answer. An answer without a top-level id is stored as it
/// is (the server does not echo ids: every caller gets the same bytes). An id other than the
/// requester's, a repeated id or an unparsable answer is not storable.
pub fn strip_json_answer(body: Vec<u8>, json_len_header: Option<&str>, id: &[u8]) -> Result<Stripped, Bypass> {
    let lines: Vec<&str> = json_len_header.into_iter().collect();
    let (json_len, binary) = split_binary(&body, &lines).map_err(|_| Bypass::Unparsable)?;
    let members = json::object_members(&body[..json_len]).ok_or(Bypass::Unparsable)?;
    let mut found: Option<usize> = None;
    for (i, m) in members.iter().enumerate() {
        if m.key_is(&body, "id") {
            if found.is_some() {
                return Err(Bypass::Unparsable);
            }
            found = Some(i);
        }
    }
    let i = match found {
        None => return Ok(Stripped { body, splice: None }),
        Some(i) => i,
    };
    let m = members[i];
    let value = m.value_raw(&body);
    // A plain id is written without escapes by every encoder: the raw token is `"<id>"`.
    if value.len() != id.len() + 2 || &value[1..value.len() - 1] != id {
        return Err(Bypass::Unparsable);
    }
    let last = i + 1 == members.len();
    let r0 = if last && i > 0 { members[i - 1].end } else { m.start };
    let r1 = if last { m.end } else { members[i + 1].start };
    let before = body[r0..m.value_start + 1].to_vec();
    let after = body[m.end - 1..r1].to_vec();
    let mut body = body;
    body.drain(r0..r1);
    Ok(Stripped { body, splice: Some(Splice::Json { at: r0 as u32, before, after, json_len_header: binary }) })
}

/// Removes the echoed id (field 3) from a ModelInferResponse message. As for JSON: no id is
/// stored as is; another id, a repeated id or a malformed message is not storable.
pub fn strip_proto_answer(message: Vec<u8>, id: &[u8]) -> Result<Stripped, Bypass> {
    let mut span: Option<(usize, usize)> = None;
    let mut fields = Fields::new(&message);
    loop {
        let start = message.len() - fields.remaining();
        match fields.next() {
            None => break,
            Some(Err(())) => return Err(Bypass::Unparsable),
            Some(Ok((3, v))) => {
                if span.is_some() || v != Value::Bytes(id) {
                    return Err(Bypass::Unparsable);
                }
                span = Some((start, message.len() - fields.remaining()));
            }
            Some(Ok(_)) => {}
        }
    }
    let (s, e) = match span {
        None => return Ok(Stripped { body: message, splice: None }),
        Some(x) => x,
    };
    let mut message = message;
    message.drain(s..e);
    Ok(Stripped { body: message, splice: Some(Splice::Proto { at: s as u32 }) })
}

/// Where a hit puts an id back and which: None when the stored bytes go out as they are (the
/// answer carried no id, or the requester has no spliced id: its key form only ever matches
/// such answers).
fn insertion<'a>(splice: Option<&'a Splice>, id: &'a RequestId) -> Option<(&'a Splice, &'a [u8])> {
    match (splice, id) {
        (Some(s), RequestId::Spliced(id)) => Some((s, id)),
        _ => None,
    }
}

/// Bytes `write_answer` adds to the stored answer for this requester.
fn inserted_len(splice: &Splice, id: &[u8]) -> usize {
    match splice {
        Splice::Json { before, after, .. } => before.len() + id.len() + after.len(),
        Splice::Proto { .. } => 1 + crate::grpc::varint_len(id.len() as u64) + id.len(),
    }
}

/// The length of the answer a hit sends (what `write_answer` appends).
pub fn answer_len(stored: &[u8], splice: Option<&Splice>, id: &RequestId) -> usize {
    stored.len() + insertion(splice, id).map_or(0, |(s, id)| inserted_len(s, id))
}

/// Appends the answer a hit sends to `out`: the stored body with the requester's id put back,
/// written in one pass (so a caller that reserved room before it, such as a gRPC frame header,
/// copies the answer once). Returns by how many bytes the JSON part grew (for
/// `inference-header-content-length`). None: the splice point lies past the stored body (a
/// corrupt entry); `out` is left as it was.
pub fn write_answer(out: &mut Vec<u8>, stored: &[u8], splice: Option<&Splice>, id: &RequestId) -> Option<usize> {
    let (splice, id) = match insertion(splice, id) {
        Some(x) => x,
        None => {
            out.extend_from_slice(stored);
            return Some(0);
        }
    };
    let at = match splice {
        Splice::Json { at, .. } | Splice::Proto { at } => *at as usize,
    };
    if at > stored.len() {
        return None;
    }
    out.reserve(stored.len() + inserted_len(splice, id));
    out.extend_from_slice(&stored[..at]);
    match splice {
        Splice::Json { before, after, .. } => {
            out.extend_from_slice(before);
            out.extend_from_slice(id);
            out.extend_from_slice(after);
        }
        Splice::Proto { .. } => {
            // Field 3, length-delimited: tag, length, id.
            out.push(0x1a);
            crate::grpc::put_varint(out, id.len() as u64);
            out.extend_from_slice(id);
        }
    }
    out.extend_from_slice(&stored[at..]);
    Some(inserted_len(splice, id))
}

/// The answer a hit sends: the stored body with the requester's id put back (borrowed when
/// nothing goes back), and by how many bytes the JSON part grew (`write_answer`).
pub fn answer_body<'s>(stored: &'s [u8], splice: Option<&Splice>, id: &RequestId) -> Option<(Cow<'s, [u8]>, usize)> {
    if insertion(splice, id).is_none() {
        return Some((Cow::Borrowed(stored), 0));
    }
    let mut out = Vec::with_capacity(answer_len(stored, splice, id));
    let grown = write_answer(&mut out, stored, splice, id)?;
    Some((Cow::Owned(out), grown))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_of(body: &[u8], rules: &JsonRules) -> Result<(Vec<u8>, RequestId), Bypass> {
        let members = json::object_members(body).ok_or(Bypass::Unparsable)?;
        let k = shape_json(body, body.len(), false, &members, rules)?;
        Ok((k.parts.concat(), k.id))
    }

    const KSERVE: JsonRules = JsonRules { request_id: true, ignore_fields: &[], deterministic_only: false };

    #[test]
    fn rest_id_left_out_wherever_it_is() {
        let want = br#"{"inputs":[{"name":"x","data":[1]}]}"#.to_vec();
        for body in [
            &br#"{"id":"a1","inputs":[{"name":"x","data":[1]}]}"#[..],
            br#"{"inputs":[{"name":"x","data":[1]}],"id":"b-2"}"#,
            br#"{"inputs":[{"name":"x","data":[1]}],"\u0069d":"c"}"#,
        ] {
            let (k, _) = key_of(body, &KSERVE).unwrap();
            assert_eq!(k, want, "{}", String::from_utf8_lossy(body));
        }
        assert_eq!(key_of(br#"{"id":"a1","x":1}"#, &KSERVE).unwrap().1, RequestId::Spliced(b"a1".to_vec()));
        assert_eq!(key_of(br#"{"x":1}"#, &KSERVE).unwrap().1, RequestId::None);
        // A nested "id" is data, not the request id.
        let nested = br#"{"inputs":[{"name":"id","id":"a","data":[1]}],"parameters":{"id":"p"}}"#;
        assert_eq!(key_of(nested, &KSERVE).unwrap(), (nested.to_vec(), RequestId::None));
        // Without the rule (OpenAI paths) the id is ordinary data.
        let plain = JsonRules::default();
        assert_eq!(key_of(br#"{"id":"a1","x":1}"#, &plain).unwrap().0, br#"{"id":"a1","x":1}"#.to_vec());
    }

    #[test]
    fn odd_rest_ids_stay_in_the_key_or_bypass() {
        for body in [&br#"{"id":"","x":1}"#[..], br#"{"id":"caf\u00e9","x":1}"#, br#"{"id":"a\"b","x":1}"#, br#"{"id":"a<b","x":1}"#] {
            let (k, id) = key_of(body, &KSERVE).unwrap();
            assert_eq!((k, id), (body.to_vec(), RequestId::Kept), "{}", String::from_utf8_lossy(body));
        }
        let long = format!(r#"{{"id":"{}","x":1}}"#, "a".repeat(MAX_SPLICED_ID_BYTES + 1));
        assert_eq!(key_of(long.as_bytes(), &KSERVE).unwrap().1, RequestId::Kept);
        for body in [&br#"{"id":"a","id":"b","x":1}"#[..], br#"{"id":7,"x":1}"#, br#"{"id":null}"#, br#"{"id":"\ud800"}"#, br#"{"id":"a""#] {
            assert_eq!(key_of(body, &KSERVE), Err(Bypass::Unparsable), "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn binary_extension_keys_the_json_part_and_its_length() {
        let json = br#"{"id":"r1","inputs":[{"name":"x","parameters":{"binary_data_size":4}}]}"#;
        let body = [&json[..], b"\x01\x02\x03\x04"].concat();
        let members = json::object_members(json).unwrap();
        let k = shape_json(&body, json.len(), true, &members, &KSERVE).unwrap();
        let kept = br#"{"inputs":[{"name":"x","parameters":{"binary_data_size":4}}]}"#;
        assert_eq!(k.parts.concat(), [&kept[..], b"\x01\x02\x03\x04"].concat());
        assert_eq!(k.json_len, Some(kept.len() as u64));
        assert_eq!(split_binary(&body, &[]), Ok((body.len(), false)));
        assert_eq!(split_binary(&body, &["3"]), Ok((3, true)));
        assert_eq!(split_binary(&body, &["003"]), Ok((3, true)), "leading zeros: every server reads 3");
        // Anything a server might read differently (or reject) is not read at all.
        for bad in [&["9999"][..], &["x"], &["+3"], &["-3"], &[" 3"], &["3 "], &["3.0"], &[""], &["0x3"], &["\u{663}"],
                    &["3", "3"], &["3", "4"], &["99999999999999999999"]] {
            assert_eq!(split_binary(&body, bad), Err(Bypass::BinaryLength), "{:?}", bad);
        }
    }

    #[test]
    fn ignore_fields_and_deterministic_only() {
        let fields = vec!["user".to_string(), "metadata".to_string()];
        let rules = JsonRules { request_id: false, ignore_fields: &fields, deterministic_only: false };
        let a = key_of(br#"{"model":"m","user":"alice","messages":[],"metadata":{"t":1}}"#, &rules).unwrap().0;
        let b = key_of(br#"{"model":"m","user":"bob","messages":[]}"#, &rules).unwrap().0;
        assert_eq!(a, b);
        assert_eq!(a, br#"{"model":"m","messages":[]}"#.to_vec());
        let det = JsonRules { request_id: false, ignore_fields: &[], deterministic_only: true };
        for (body, ok) in [
            (&br#"{"model":"m","temperature":0}"#[..], true),
            (br#"{"model":"m","temperature":0.0,"seed":null}"#, true),
            (br#"{"model":"m","temperature":-0.0}"#, true),
            (br#"{"model":"m","temperature":0.7,"seed":42}"#, true),
            (br#"{"model":"m","temperature":0.7}"#, false),
            (br#"{"model":"m","temperature":1e-9,"seed":null}"#, false),
            (br#"{"model":"m"}"#, false),
            (br#"{"model":"m","temperature":null}"#, false),
            (br#"{"model":"m","seed":1}"#, true),
            (br#"{"model":"m","seed":0}"#, true),
            (br#"{"model":"m","seed":4294967294}"#, true),
            // Only a non-negative integer seed makes a sample repeatable: -1 is "random" to
            // llama.cpp-style servers, as is 4294967295 (-1 as a u32).
            (br#"{"model":"m","seed":-1}"#, false),
            (br#"{"model":"m","seed":-7}"#, false),
            (br#"{"model":"m","seed":-0}"#, false),
            (br#"{"model":"m","seed":4294967295}"#, false),
            (br#"{"model":"m","seed":false}"#, false),
            (br#"{"model":"m","seed":"x"}"#, false),
            (br#"{"model":"m","seed":{}}"#, false),
            (br#"{"model":"m","seed":1.5}"#, false),
            (br#"{"model":"m","seed":1e3}"#, false),
            (br#"{"model":"m","seed":[1]}"#, false),
        ] {
            let got = key_of(body, &det);
            assert_eq!(got.is_ok(), ok, "{}", String::from_utf8_lossy(body));
            if !ok {
                assert_eq!(got.unwrap_err(), Bypass::Nondeterministic);
            }
        }
        // Several choices and offered tools bypass even at temperature 0 (each with its reason).
        for (body, why) in [
            (&br#"{"model":"m","temperature":0,"n":1}"#[..], None),
            (br#"{"model":"m","temperature":0,"n":null}"#, None),
            (br#"{"model":"m","temperature":0,"tools":[]}"#, None),
            (br#"{"model":"m","temperature":0,"tools":[ ],"functions":null}"#, None),
            (br#"{"model":"m","temperature":0,"tool_choice":"none"}"#, None),
            (br#"{"model":"m","temperature":0,"n":2}"#, Some(Bypass::MultipleChoices)),
            (br#"{"model":"m","temperature":0,"n":1.0}"#, Some(Bypass::MultipleChoices)),
            (br#"{"model":"m","temperature":0.7,"seed":3,"n":"2"}"#, Some(Bypass::MultipleChoices)),
            (br#"{"model":"m","temperature":0,"tools":[{"type":"function","function":{"name":"f"}}]}"#, Some(Bypass::ToolCalls)),
            (br#"{"model":"m","temperature":0,"functions":[{"name":"f"}]}"#, Some(Bypass::ToolCalls)),
            (br#"{"model":"m","temperature":0,"tools":{}}"#, Some(Bypass::ToolCalls)),
            (br#"{"model":"m","temperature":0,"n":1,"n":2}"#, Some(Bypass::Unparsable)),
            (br#"{"model":"m","temperature":0,"tools":[],"tools":[1]}"#, Some(Bypass::Unparsable)),
        ] {
            assert_eq!(key_of(body, &det).err(), why, "{}", String::from_utf8_lossy(body));
        }
        // Without deterministic_only they are keyed like any field.
        assert!(key_of(br#"{"model":"m","n":2,"tools":[1]}"#, &rules).is_ok());
        assert_eq!(key_of(br#"{"temperature":"hot"}"#, &det), Err(Bypass::Unparsable));
        assert_eq!(key_of(br#"{"temperature":0,"temperature":1}"#, &det), Err(Bypass::Unparsable));
        assert_eq!(key_of(br#"{"temperature":1,"seed":1,"seed":null}"#, &det), Err(Bypass::Unparsable), "repeated seed");
    }

    fn pb_string(field: u8, s: &[u8]) -> Vec<u8> {
        let mut out = vec![field << 3 | 2];
        crate::grpc::put_varint(&mut out, s.len() as u64);
        out.extend_from_slice(s);
        out
    }

    #[test]
    fn grpc_id_left_out() {
        let inputs = pb_string(5, b"\x0a\x01x\x12\x04FP32");
        let with = [pb_string(1, b"m"), pb_string(3, b"req-1"), inputs.clone()].concat();
        let other = [pb_string(1, b"m"), pb_string(3, b"another-id"), inputs.clone()].concat();
        let without = [pb_string(1, b"m"), inputs.clone()].concat();
        let a = grpc_request(&with).unwrap();
        let b = grpc_request(&other).unwrap();
        let c = grpc_request(&without).unwrap();
        assert_eq!(a.key.parts.concat(), without);
        assert_eq!(b.key.parts.concat(), without);
        assert_eq!(c.key.parts.concat(), without);
        assert_eq!(a.key.id, RequestId::Spliced(b"req-1".to_vec()));
        assert_eq!(c.key.id, RequestId::None);
        assert_eq!((a.model_name.as_str(), a.model_version.as_str()), ("m", ""));
        // Repeated ids: the last wins (protobuf semantics), all are left out.
        let twice = [pb_string(3, b"x"), pb_string(1, b"m"), pb_string(3, b"y"), inputs.clone()].concat();
        let t = grpc_request(&twice).unwrap();
        assert_eq!(t.key.parts.concat(), without);
        assert_eq!(t.key.id, RequestId::Spliced(b"y".to_vec()));
        // An explicit empty id is no id.
        let empty = [pb_string(1, b"m"), pb_string(3, b""), inputs.clone()].concat();
        assert_eq!(grpc_request(&empty).unwrap().key.id, RequestId::None);
        let long = [pb_string(1, b"m"), pb_string(3, &[b'a'; MAX_SPLICED_ID_BYTES + 1]), inputs].concat();
        let l = grpc_request(&long).unwrap();
        assert_eq!((l.key.parts.concat(), l.key.id), (long.clone(), RequestId::Kept));
    }

    #[test]
    fn grpc_odd_encodings_are_unparsable() {
        let bad: Vec<Vec<u8>> = vec![
            vec![0x18, 0x01],                                   // id as a varint
            vec![0x0d, 1, 2, 3, 4],                             // model_name as fixed32
            pb_string(3, b"\xff\xfe"),                          // id not UTF-8
            pb_string(1, b"\xc3"),                              // name not UTF-8
            vec![0x1a, 0x05, b'a'],                             // truncated
            vec![0x1a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01], // huge length
            vec![0x1a, 0x80, 0x80, 0x80, 0x80, 0x10, b'a'],     // length 2^32 (wraps on 32-bit)
            vec![0xfa, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f], // 11-byte varint tag
            vec![0x00],                                         // field 0
            vec![0x0b],                                         // group wire type
        ];
        for b in bad {
            assert_eq!(grpc_request(&b), Err(Bypass::Unparsable), "{:?}", b);
        }
    }

    #[test]
    fn json_answers_round_trip_byte_exact() {
        // The engine's layout (compact, id after model_version) and others: id first, last, spaced.
        let answers: [&[u8]; 4] = [
            br#"{"model_name":"m","model_version":"1","id":"req-1","outputs":[{"name":"y","data":[2]}]}"#,
            br#"{"id":"req-1","model_name":"m","outputs":[]}"#,
            br#"{"model_name": "m", "outputs": [], "id": "req-1"}"#,
            br#"{"id":"req-1"}"#,
        ];
        for a in answers.iter() {
            let s = strip_json_answer(a.to_vec(), None, b"req-1").unwrap();
            assert!(!s.body.windows(5).any(|w| w == b"req-1"));
            assert!(json::object_members(&s.body).is_some(), "stripped answer stays valid JSON");
            let back = answer_body(&s.body, s.splice.as_ref(), &RequestId::Spliced(b"req-1".to_vec())).unwrap();
            assert_eq!(back.0, a.to_vec());
            let other = answer_body(&s.body, s.splice.as_ref(), &RequestId::Spliced(b"Z9".to_vec())).unwrap();
            let want = String::from_utf8(a.to_vec()).unwrap().replace("req-1", "Z9");
            assert_eq!(other.0, want.into_bytes());
        }
        // No id echoed: stored and replayed as is.
        let plain = br#"{"outputs":[]}"#.to_vec();
        let s = strip_json_answer(plain.clone(), None, b"req-1").unwrap();
        assert_eq!((s.body.clone(), s.splice.clone()), (plain.clone(), None));
        assert_eq!(answer_body(&s.body, None, &RequestId::Spliced(b"x".to_vec())).unwrap().0, plain);
        // Another id, a repeated id, an escaped echo or broken JSON: not storable.
        for bad in [&br#"{"id":"other"}"#[..], br#"{"id":"req-1","id":"req-1"}"#, br#"{"id":"req\u002d1"}"#, br#"{"id":"req-1""#] {
            assert_eq!(strip_json_answer(bad.to_vec(), None, b"req-1"), Err(Bypass::Unparsable));
        }
    }

    #[test]
    fn binary_json_answer_records_the_header_growth() {
        let json = br#"{"model_name":"m","id":"r1","outputs":[{"name":"y","parameters":{"binary_data_size":2}}]}"#;
        let body = [&json[..], b"\x00\x01"].concat();
        let header = json.len().to_string();
        let s = strip_json_answer(body.clone(), Some(&header), b"r1").unwrap();
        match &s.splice {
            Some(Splice::Json { json_len_header: true, .. }) => {}
            other => panic!("{:?}", other),
        }
        let (back, grown) = answer_body(&s.body, s.splice.as_ref(), &RequestId::Spliced(b"r1".to_vec())).unwrap();
        assert_eq!(back, body);
        assert_eq!(s.body.len() + grown, body.len());
    }

    #[test]
    fn proto_answers_round_trip_byte_exact() {
        let outputs = pb_string(5, b"\x0a\x01y");
        let answer = [pb_string(1, b"m"), pb_string(2, b"1"), pb_string(3, b"req-1"), outputs.clone()].concat();
        let s = strip_proto_answer(answer.clone(), b"req-1").unwrap();
        assert_eq!(s.body, [pb_string(1, b"m"), pb_string(2, b"1"), outputs.clone()].concat());
        assert_eq!(answer_body(&s.body, s.splice.as_ref(), &RequestId::Spliced(b"req-1".to_vec())).unwrap().0, answer);
        let long_id = vec![b'q'; 200]; // two-byte length varint
        let want = [pb_string(1, b"m"), pb_string(2, b"1"), pb_string(3, &long_id), outputs.clone()].concat();
        assert_eq!(answer_body(&s.body, s.splice.as_ref(), &RequestId::Spliced(long_id)).unwrap().0, want);
        let none = [pb_string(1, b"m"), outputs.clone()].concat();
        assert_eq!(strip_proto_answer(none.clone(), b"req-1").unwrap(), Stripped { body: none, splice: None });
        assert_eq!(strip_proto_answer(pb_string(3, b"other"), b"req-1"), Err(Bypass::Unparsable));
        assert_eq!(strip_proto_answer([pb_string(3, b"req-1"), pb_string(3, b"req-1")].concat(), b"req-1"), Err(Bypass::Unparsable));
        assert_eq!(strip_proto_answer(vec![0x1a, 9, b'r'], b"req-1"), Err(Bypass::Unparsable));
        // A splice point past the stored body (corrupt entry) is refused, not a panic.
        assert_eq!(answer_body(b"ab", Some(&Splice::Proto { at: 9 }), &RequestId::Spliced(b"x".to_vec())), None);
    }

    #[test]
    fn random_protobuf_never_panics_and_strips_consistently() {
        let mut x: u64 = 0x1234_5678_9abc_def1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let base = [pb_string(1, b"m"), pb_string(3, b"id-1"), pb_string(5, b"\x0a\x01x")].concat();
        for _ in 0..20_000 {
            let mut msg = base.clone();
            for _ in 0..1 + next() % 3 {
                let at = (next() % (msg.len() as u64 + 1)) as usize;
                let b = next() as u8;
                if next() % 2 == 0 || at == msg.len() {
                    msg.insert(at, b);
                } else {
                    msg[at] = b;
                }
            }
            if let Ok(req) = grpc_request(&msg) {
                if let RequestId::Spliced(id) = &req.key.id {
                    // The id left the key; putting it back where the answer had it restores it.
                    let stripped = strip_proto_answer(msg.clone(), id);
                    if let Ok(Stripped { body, splice: Some(sp) }) = stripped {
                        let (back, _) = answer_body(&body, Some(&sp), &req.key.id).unwrap();
                        assert_eq!(back, msg);
                    }
                }
            }
            let _ = strip_json_answer(msg.clone(), None, b"id-1");
        }
    }

    /// Host timing of the parsing work per request (not a test of speed: run with
    /// `cargo test --release -- --ignored --nocapture cost_per_request`). Native x86, so wasm
    /// under V8 costs a small multiple of this.
    #[test]
    #[ignore]
    fn cost_per_request() {
        let request = br#"{"id": "req-123456", "n": 42, "x": [{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 32], "data": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]}]}]}"#;
        for size in [1024usize, 65536] {
            let answer = format!(r#"{{"id":"req-123456","outputs":"{}"}}"#, "x".repeat(size - 40)).into_bytes();
            let n = 20_000;
            let t = std::time::Instant::now();
            for _ in 0..n {
                let members = json::object_members(request).unwrap();
                let k = shape_json(request, request.len(), false, &members, &KSERVE).unwrap();
                assert!(!k.parts.is_empty());
            }
            let key_us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
            let t = std::time::Instant::now();
            let mut stored = None;
            for _ in 0..n / 10 {
                stored = Some(strip_json_answer(answer.clone(), None, b"req-123456").unwrap());
            }
            let strip_us = t.elapsed().as_secs_f64() * 1e6 / (n / 10) as f64;
            let s = stored.unwrap();
            let t = std::time::Instant::now();
            for _ in 0..n / 10 {
                assert!(json::object_members(&answer).is_some());
            }
            let scan_us = t.elapsed().as_secs_f64() * 1e6 / (n / 10) as f64;
            println!("  (of the strip, the validating scan: {:.2} us)", scan_us);
            let id = RequestId::Spliced(b"req-999".to_vec());
            let t = std::time::Instant::now();
            for _ in 0..n / 10 {
                assert!(answer_body(&s.body, s.splice.as_ref(), &id).is_some());
            }
            let splice_us = t.elapsed().as_secs_f64() * 1e6 / (n / 10) as f64;
            println!("answer {} B: request key {:.2} us, answer strip {:.2} us, hit splice {:.2} us", size, key_us, strip_us, splice_us);
        }
    }
}
