//! `purge`.

use actix_outbox_test_support::TestDb;

use crate::common::*;

#[tokio::test]
async fn purge_deletes_only_done_rows_older_than_the_age_given() {
    let db = TestDb::new().await;
    db.seed(7, "agg").await;
    execute(
        &db,
        "UPDATE outbox SET status = 'done', done_at = now() - interval '8 days' WHERE id IN (1, 2, 3);
         UPDATE outbox SET status = 'done', done_at = now() - interval '6 days' WHERE id = 4;
         UPDATE outbox SET status = 'dead', created_at = now() - interval '30 days' WHERE id = 5;
         UPDATE outbox SET created_at = now() - interval '30 days' WHERE id = 6;",
    )
    .await;
    let out = ok(&db.url, &["purge", "--older-than", "7d", "--batch", "2"]).await;
    assert_eq!(out.trim(), "purged 3 done rows older than 7days");
    assert_eq!(db.rows().await.iter().map(|r| r.id).collect::<Vec<_>>(), [4, 5, 6, 7]);

    let out = ok(&db.url, &["purge", "--older-than", "7d"]).await;
    assert_eq!(out.trim(), "purged 0 done rows older than 7days");
}
