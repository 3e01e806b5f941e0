-- Dead rows get back an available_at in the past; nothing else needs undoing.
UPDATE outbox SET available_at = created_at WHERE status = 'dead' AND available_at = '9999-12-31 00:00:00+00';
