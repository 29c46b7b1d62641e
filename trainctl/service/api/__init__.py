"""The API room: the gRPC servicer (`servicer`, its sweep methods in `sweep_rpcs`), the call pipeline and the
server's event loop (`rpc_calls`, `rpc_server`, `async_bridge`), the answers it keeps built (`job_messages`), the
watch fan-out (`watch_hub`) and the caller-visible record lookup (`owned_records`)."""
