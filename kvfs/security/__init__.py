"""The cluster's credentials: its certificate authority (ca), identity bundles and TLS contexts
(credentials), private key files (keyfiles)."""
