// @generated automatically by Diesel CLI.

diesel::table! {
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
    }
}
