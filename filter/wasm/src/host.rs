//! The proxy-wasm buffers and header maps the Wasm host reads or writes, by their ABI numbers.
//! The flow's host (`meshcache_core::host::Host`) over this ABI is `abi_host::Abi`.

/// The proxy-wasm buffers the filter reads or writes (their ABI numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Buffer {
    RequestBody = 0,
    ResponseBody = 1,
    HttpCallResponseBody = 4,
    PluginConfiguration = 7,
}

/// The proxy-wasm header maps (their ABI numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Map {
    RequestHeaders = 0,
    ResponseHeaders = 2,
    ResponseTrailers = 3,
    HttpCallResponseHeaders = 6,
    HttpCallResponseTrailers = 7,
}
