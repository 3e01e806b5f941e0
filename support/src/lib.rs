//! Fixtures shared by the library's integration tests (`tests/it`), the command line's tests
//! (`cli/tests`) and the chaos run (`chaos/`), so that all of them fault the services through
//! one implementation.
//!
//! - [`proxy::Proxy`]: a TCP proxy in front of PostgreSQL or RabbitMQ that cuts, refuses,
//!   blackholes, delays and slows its connections, and plays RabbitMQ's `connection.blocked`.

pub mod proxy;
