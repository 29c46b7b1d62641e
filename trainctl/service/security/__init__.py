"""The security room: bearer-token authentication (`auth`), tenants, roles and quotas (`tenancy`), where a job's
paths may point (`paths`) and the transport's limits (`hardening`). docs/security.md has the threat model."""
