// @generated automatically by Diesel CLI.

pub mod sql_types {
    /// PostgreSQL's `xid8`: a 64-bit transaction id (`pg_current_xact_id()`).
    #[derive(Debug, diesel::sql_types::SqlType)]
    #[diesel(postgres_type(name = "xid8"))]
    pub struct Xid8;
}

diesel::table! {
    use diesel::sql_types::*;
    use super::sql_types::Xid8;

    outbox (id) {
        id -> Int8,
        aggregate_type -> Text,
        aggregate_id -> Text,
        event_type -> Text,
        payload -> Jsonb,
        created_at -> Timestamptz,
        status -> Text,
        available_at -> Timestamptz,
        attempts -> Int4,
        lease_owner -> Nullable<Text>,
        lease_until -> Nullable<Timestamptz>,
        lease_version -> Int8,
        last_error -> Nullable<Text>,
        done_at -> Nullable<Timestamptz>,
        headers -> Nullable<Jsonb>,
        txid -> Nullable<Xid8>,
    }
}
