//! The inbox tables (`migrations/inbox/`), for typed Diesel queries.

diesel::table! {
    /// One row per message a consumer has handled.
    inbox (consumer, source, message_id) {
        consumer -> Text,
        message_id -> Int8,
        event_type -> Text,
        aggregate_type -> Text,
        aggregate_id -> Text,
        late -> Bool,
        received_at -> Timestamptz,
        source -> Text,
    }
}

diesel::table! {
    /// The highest message id an ordered consumer applied, per aggregate.
    inbox_aggregates (consumer, source, aggregate_type, aggregate_id) {
        consumer -> Text,
        aggregate_type -> Text,
        aggregate_id -> Text,
        last_message_id -> Int8,
        updated_at -> Timestamptz,
        source -> Text,
    }
}

diesel::allow_tables_to_appear_in_same_query!(inbox, inbox_aggregates);
